"""Tracer round trip: trace in plain CPython -> JSON -> compile -> run, including a
whole prompt-lookup speculative loop on a fake model checked against greedy decoding."""

import json

import pytest
import torch

from host.epilogue import Env, SimpleChannel, apply_writes, compile_program


from guest import trace
V = 11


def test_brief_example_round_trip():
    eos, limit = 3, 5
    p = trace.Program(window=1, readout=1)
    p.channel("out", "i64", 16)
    p.channel("window", "i64", 1)
    logits = p.logits()
    tok = logits.argmax(-1)
    p.put("out", tok[-1:])
    p.set("window", tok[-1:])
    p.fold(p.const(1))
    p.stop_if((tok[-1] == eos) | (p.round() >= limit))
    text = p.to_json()
    assert json.loads(text)["version"] == 1
    prog = compile_program(text)
    chans = {"out": SimpleChannel.empty(16), "window": SimpleChannel.empty(1)}
    lg = torch.zeros(1, V)
    lg[0, 7] = 1
    r = prog.run([Env(logits=lg, window=torch.tensor([2]), channels=chans, round=0)])[0]
    assert int(r.fold) == 1 and not bool(r.stop)
    apply_writes(r, chans)
    assert chans["out"].buf[:1].tolist() == [7] and chans["window"].buf.tolist() == [7]
    lg[0, 3] = 2
    r = prog.run([Env(logits=lg, window=torch.tensor([7]), channels=chans, round=1)])[0]
    assert bool(r.stop)
    assert bool(prog.run([Env(logits=torch.zeros(1, V), window=torch.tensor([7]), channels=chans, round=5)])[0].stop)


def test_tracer_errors():
    p = trace.Program()
    x = p.logits()
    with pytest.raises(trace.TraceError):
        bool(x > 0)
    with pytest.raises(trace.TraceError):
        p.put("nope", x.argmax())
    with pytest.raises(trace.TraceError):
        x.argmax() + 0.5
    p.fold(1)
    with pytest.raises(trace.TraceError):
        p.fold(1)


def next_token(seq):
    """The fake target model: a deterministic function of the last two tokens."""
    a, b = (seq[-2] if len(seq) > 1 else 0), seq[-1]
    return (a * 3 + b * 5 + (1 if a == b else 0)) % V


def fake_logits(history, window):
    rows = []
    for i in range(len(window)):
        lg = torch.zeros(V)
        lg[next_token(history + window[:i + 1])] = 1.0
        rows.append(lg)
    return torch.stack(rows)


def spec_program(k):
    p = trace.Program(window=k + 1, readout=k + 1)
    p.channel("out", "i64", 128)
    p.channel("next", "i64", k + 1)
    w, hist = p.window(), p.history()
    acc, toks, cnt = p.verify_greedy(w[1:], p.logits().argmax())
    p.put("out", toks, cnt)
    p.fold(cnt)  # the window's first token and the accepted drafts become state
    seq = p.concat(p.concat(hist, w[:1]), toks)  # everything known, padded with -1 at the end
    drafts, dcnt = p.ngram_lookup(seq, k, ngram_min=1, ngram_max=3, length=hist.size() + 1 + cnt)
    last = p.dyn_slice(toks, cnt - 1, 1, size=1)
    p.set("next", p.pack(last, 1, drafts, dcnt, size=k + 1, fill=0))
    p.stop_if(p.length("out") + cnt >= 40)
    return p.to_json()


def test_prompt_lookup_speculative_loop_is_lossless():
    k = 3
    prog = compile_program(spec_program(k))
    prompt = [1, 2, 3, 1, 2]
    ref = list(prompt)
    while len(ref) < len(prompt) + 60:
        ref.append(next_token(ref))
    chans = {"out": SimpleChannel.empty(128), "next": SimpleChannel.empty(k + 1)}
    history, window = prompt[:-1], [prompt[-1]] + [0] * k
    rounds, accepted = 0, 0
    while True:
        env = Env(logits=fake_logits(history, window), window=torch.tensor(window),
                  history=torch.tensor(history), channels=chans, seed=1, round=rounds)
        r = prog.run([env])[0]
        apply_writes(r, chans)
        fold, stop = int(r.fold), bool(r.stop)  # the host's one read per round
        history += window[:fold]
        accepted += fold - 1
        window = chans["next"].buf.tolist()
        rounds += 1
        if stop:
            break
    n = int(chans["out"].length)
    assert chans["out"].buf[:n].tolist() == ref[len(prompt):len(prompt) + n]
    assert n >= 40 and accepted > 0 and rounds < n  # drafts were accepted: fewer passes than tokens

"""Logprobs (host/engine/logprobs.py) on the default model: every inferlet's tokens carry the very
float32 values plain decoding of the same tokens gives (one prompt pass, then one row per token,
straight through the engine), greedy and seeded-sampled, whatever drafted them; and they equal HF's
log_softmax of the same weights within 1e-4."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import dev_prompts
from wasm_fixtures import build_inferlet
from wasm_fixtures import *  # noqa: F401,F403 (fixtures)

pytestmark = [pytest.mark.wasm, pytest.mark.model]

N = 40
TOP = 3
SAMPLED = ("--temperature", "0.9", "--top-p", "0.95", "--seed", "4321")
PROMPTS = (0, 9)  # dev prompts: a code question and a repetitive one (lookup drafts land)


def _args(prompt: str, *extra: str) -> list[str]:
    return ["--prompt", prompt, "--chat", "--max-tokens", str(N), *extra]


def plain_logprobs(engine, prompt: list[int], tokens: list[int]) -> list[tuple[float, list]]:
    """(logprob, top) of each of `tokens` after `prompt`, as plain decoding computes them: the
    prompt's pass, then one pass of one row per token."""
    from host.engine import Pass
    from host.engine.compute import compute

    def run():
        ws = engine.new_working_set()
        try:
            rows = [engine.forward([Pass(ws, prompt, [len(prompt) - 1])])[0].logits[0]]
            for t in tokens[:-1]:
                rows.append(engine.forward([Pass(ws, [t], [0])])[0].logits[0])
        finally:
            engine.release(ws)
        out = []
        for row, t in zip(rows, tokens):
            lp = torch.log_softmax(row, -1)
            vals, ids = torch.topk(lp, TOP)
            out.append((float(lp[t]), sorted(zip(ids.tolist(), vals.tolist()), key=lambda x: (-x[1], x[0]))))
        return out
    return compute().call(run)


@pytest.fixture(scope="module")
def wasms(text_completion_wasm):
    return {"text-completion": text_completion_wasm, **{n: build_inferlet(n) for n in (
        "cacheback-speculative-decoding", "mtp-speculative-decoding", "ngram-proposer",
        "constrained-speculative-decoding")}}


def _jobs(drafter: str) -> dict[str, tuple[str, tuple]]:
    schema = json.dumps({"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]})
    return {
        "text-completion": ("text-completion", ()),
        "text-completion guest loop": ("text-completion", ("--loop", "guest")),
        "cacheback": ("cacheback-speculative-decoding", ()),
        "mtp": ("mtp-speculative-decoding", ()),
        "hybrid": ("cacheback-speculative-decoding", ("--drafter", drafter)),
        "ngram-proposer": ("ngram-proposer", ()),
        "constrained": ("constrained-speculative-decoding", ("--json-schema", schema)),
    }


@pytest.fixture(scope="module")
def runs(runtime, wasms):
    """{(job, sampled, prompt index): RunResult}, all started at once (the engine batches them)."""
    drafter = runtime.engine.info.drafters[0]
    handles = {}
    for i in PROMPTS:
        prompt = dev_prompts()[i]["prompt"]
        for name, (wasm, extra) in _jobs(drafter).items():
            for sampled in (False, True):
                a = _args(prompt, *extra, *(SAMPLED if sampled else ()))
                handles[(name, sampled, i)] = runtime.start(wasms[wasm], a, logprobs=TOP)
    return {k: h.result(timeout=900) for k, h in handles.items()}


def test_every_inferlets_logprobs_are_plain_decodings_bits(runs, engine, chat_ids):
    for (name, sampled, i), r in runs.items():
        assert r.ok, (name, r.error)
        assert len(r.logprobs) == len(r.token_ids) > 0, name
        want = plain_logprobs(engine, chat_ids[i], r.token_ids)
        for k, (got, (value, top)) in enumerate(zip(r.logprobs, want)):
            assert got.token == r.token_ids[k]
            assert got.logprob == value, f"{name} sampled={sampled} prompt {i} token {k}"
            assert [list(t) for t in got.top] == [list(t) for t in top]
            assert got.logprob <= 0 and all(v <= 0 for _, v in got.top)
        if not sampled and name != "constrained":  # greedy: each token is its row's most likely one
            # (the grammar's tokens need not be: these are the model's raw logprobs)
            assert all(lp.logprob == lp.top[0][1] for lp in r.logprobs), name


def test_greedy_speculative_runs_give_text_completions_tokens_and_logprobs(runs):
    for (name, sampled, i), r in runs.items():
        ref = runs[("text-completion", False, i)]
        if sampled or name == "constrained":
            continue
        assert r.token_ids == ref.token_ids, name
        assert [t.logprob for t in r.logprobs] == [t.logprob for t in ref.logprobs], name
    # the drafters did draft: the equality above is not that of plain decoding with itself
    assert any(runs[(n, False, i)].stats["accepted_tokens"] > 0 for n in ("cacheback", "mtp") for i in PROMPTS)


def test_logprobs_equal_hfs_log_softmax(runs, chat_ids, engine):
    from host import store
    from host.engine.compute import compute

    rec = store.read_record(engine.info.name)
    ref = compute().call(lambda: store.load_model(rec, "cpu", "float32", keep_blocks=False).eval())
    for i in PROMPTS:
        r = runs[("cacheback", True, i)]
        ids = chat_ids[i] + r.token_ids

        def score():
            with torch.inference_mode():
                logits = ref(torch.tensor([ids])).logits[0].float()
            return torch.log_softmax(logits, -1)
        lp = compute().call(score)
        n = len(chat_ids[i])
        hf = [float(lp[n - 1 + k, t]) for k, t in enumerate(r.token_ids)]
        got = [t.logprob for t in r.logprobs]
        assert max(abs(a - b) for a, b in zip(got, hf)) < 1e-4


def test_runs_without_logprobs_report_none(runtime, text_completion_wasm):
    r = runtime.run(text_completion_wasm, _args("Hi", "--max-tokens", "4"))
    assert r.ok and r.logprobs is None and "logprobs" not in r.to_json()


def test_row_scores_match_emitted_ids_to_the_rows_that_predicted_them():
    from host.engine.logprobs import RowScores

    vocab = 11
    logits = torch.randn(40, vocab)  # row p: the logits at position p
    s = RowScores(top=2)
    s.record(0, [9], logits[9:10])  # a prompt pass over positions 0..9, its last row read out
    # the first emission ends at the next position (10): the id the prompt's last row predicted
    (first,) = s.take([3], 10)
    assert first.logprob == float(torch.log_softmax(logits[9], -1)[3]) and len(first.top) == 2
    s.record(10, [0, 1, 2, 3], logits[10:14])  # a verify window at 10..13
    got = s.take([4, 5, 6], 13)  # ids at 11, 12, 13: rows 10, 11, 12
    assert [g.logprob for g in got] == [float(torch.log_softmax(logits[p], -1)[t]) for p, t in ((10, 4), (11, 5), (12, 6))]
    s.record(13, [0], logits[13:14])  # the next round at 13 replaces the window's row 13
    assert s.take([7], 14)[0].logprob == float(torch.log_softmax(logits[13], -1)[7])
    fork = s.fork()
    s.record(14, [0], logits[14:15])
    assert s.take([8], 15)[0].logprob == float(torch.log_softmax(logits[14], -1)[8])
    assert fork.take([8], 15)[0].logprob is None  # the fork's own cursor; it never saw row 14
    assert s.take([1], 16)[0].logprob is None  # nothing scored position 15
    # a long prompt's rows: only the last KEEP are kept
    s = RowScores(top=0)
    s.record(0, list(range(40)), logits)
    assert len(s._rows) == RowScores.KEEP + 1 and s.take([2], 40)[0].top == ()

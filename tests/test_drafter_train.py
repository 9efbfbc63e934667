"""`pie drafter train`: self-distilling an MTP head, on a tiny random Llama (no download, seconds)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from host.drafter import train as T
from host.drafter.mtp import load_head
from host.drafter.prompts import context_prompts, is_validation, training_prompts, vocabulary_words


@pytest.fixture
def target():
    from transformers import LlamaForCausalLM

    from host.conformance.models import TinyTokenizer, tiny_config

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(tiny_config()).eval()
    return model, TinyTokenizer()


PROMPTS = [p[:40] for p in training_prompts()[:40]]


def _cfg(tmp_path, **kw):
    base = dict(name="tiny-mtp", out=tmp_path / "out", work_dir=tmp_path / "work", tokens=800, max_new_tokens=24,
                gen_batch=8, gen_dtype="auto", epochs=6, lr=3e-3, batch=4, eval_points=3, ckpt_every=5,
                progress=False, seed=0)
    base.update(kw)
    return T.TrainConfig(**base)


def test_prompt_set_is_deterministic_and_diverse():
    a, b = training_prompts(), training_prompts()
    assert a == b and len(a) >= 500 and len(set(a)) == len(a)
    head = a[:200]
    assert any("function" in p for p in head) and any("story" in p.lower() for p in head)
    assert any("dialogue" in p.lower() or "conversation" in p.lower() for p in head)
    assert sum(is_validation(i) for i in range(100)) == 10


class _Vocab:
    def get_vocab(self):
        pieces = ["\u0120castle", "\u0120gardens", "\u0120The", "\u0120ab", "\u2581lantern", "\u0120na\u00efve", "teapot",
                  "\u0120x1ylophone", "\u0120extraordinarily", "\u0120harbour", "\u0120whistle", "\u0120meadow"]
        return {t: i for i, t in enumerate(pieces)}


def test_word_prompts_use_each_vocabulary_word_once():
    """Word topics come from whole lowercase words of the vocabulary (a leading-space piece), and
    each appears in one prompt only: a topic recurring across prompts is what the head memorised."""
    words = vocabulary_words(_Vocab())
    assert words == ["castle", "gardens", "harbour", "lantern", "meadow", "whistle"]
    many = [f"word{chr(97 + i // 26)}{chr(97 + i % 26)}" for i in range(600)]
    a = training_prompts(0, many)
    assert a == training_prompts(0, many) and len(set(a)) == len(a)
    assert a != training_prompts(1, many) and set(training_prompts()) < set(a)
    for w in many:
        assert sum(bool(re.search(rf"\b{w}\b", p, re.IGNORECASE)) for p in a) == 1, w
    head = a[:190]
    assert 50 <= sum(any(w in p for w in many) for p in head) <= 70  # 6 of every 19
    assert any("function" in p for p in head) and any("photosynthesis" in p or "Olympic" in p or "quantum" in p
                                                       for p in training_prompts()[:20])


def test_context_prompts_keep_the_split_apart():
    """Second-round prompts embed first-round replies; a held-apart reply only ever appears in a
    held-apart prompt, and the same inputs give the same prompts."""
    passages = [(i, f"reply-{i} is {'held apart' if is_validation(i) else 'trained on'}.") for i in range(40)]
    a = context_prompts(passages, 40, 200, seed=3)
    assert a == context_prompts(passages, 40, 200, seed=3) and len(a) == 200
    assert a != context_prompts(passages, 40, 200, seed=4)
    for j, p in enumerate(a):
        held = is_validation(40 + j)
        assert ("held apart" in p) == held and ("trained on" in p) == (not held), p
    assert any("Document 2:" in p or "Text B:" in p or "Passage 2:" in p for p in a)  # two passages now and then
    with pytest.raises(ValueError, match="no first-round replies"):
        context_prompts([(0, "only a training reply")], 9, 1)


def test_chain_mask():
    m = T._chain_mask(3, 2, "cpu")[0, 0]
    assert m.tolist() == [[1, 0, 0, 1, 0, 0], [1, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 1]]


def test_inline_features_match_a_forward(tmp_path, target):
    """h and the argmax captured while generating (left-padded, one row per decode step) are the
    ones a plain forward over prompt + reply gives, row for row."""
    model, tok = target
    cfg = _cfg(tmp_path, tokens=100).resolved()
    seqs = T.generate(model, tok, PROMPTS[:8], cfg, tmp_path / "w1")
    plain = [{k: (v.tolist() if k == "ids" else v) for k, v in q.items() if k not in ("h", "choice")} for q in seqs]
    ref = T.capture(model, plain, cfg, tmp_path / "w2")
    assert len(seqs) == len(ref) == 8 and len({len(q["ids"]) for q in seqs}) >= 1
    for a, b in zip(seqs, ref):
        L, P = len(a["ids"]), a["prompt_len"]
        assert a["h"].shape == (L - 1, 64) and torch.equal(a["ids"], b["ids"])
        torch.testing.assert_close(a["h"].float(), b["h"][:L - 1].float(), atol=2e-2, rtol=2e-2)
        assert torch.equal(a["choice"][P - 1:L - 1], b["choice"][P - 1:L - 1])
        assert torch.equal(a["choice"][P - 1:L - 1].long(), a["ids"][P:].long())  # greedy


def test_inline_layer_features_match_a_forward(tmp_path, target):
    """An eagle3 head's input, the inputs of its layers captured while generating, is what a plain
    forward over prompt + reply gives (transformers' hidden_states; layer 2 of 2: h itself)."""
    model, tok = target
    cfg = _cfg(tmp_path, tokens=60, layers=[0, 1, 2]).resolved()
    seqs = T.generate(model, tok, PROMPTS[:4], cfg, tmp_path / "w1")
    plain = [{k: (v.tolist() if k == "ids" else v) for k, v in q.items() if k not in ("h", "choice", "feat")}
             for q in seqs]
    ref = T.capture(model, plain, cfg, tmp_path / "w2")
    for a, b in zip(seqs, ref):
        L = len(a["ids"])
        assert a["feat"].shape == (L - 1, 3 * 64) and b["feat"].shape == (L, 3 * 64)
        torch.testing.assert_close(a["feat"].float(), b["feat"][:L - 1].float(), atol=2e-2, rtol=2e-2)
        assert torch.equal(a["feat"][:, 128:], a["h"])  # the last entry: the final norm's input
        with torch.inference_mode():
            hs = model.model(torch.tensor([a["ids"].tolist()]), output_hidden_states=True).hidden_states
        torch.testing.assert_close(b["feat"][:, :128].float(), torch.cat([hs[0][0], hs[1][0]], -1),
                                   atol=2e-2, rtol=2e-2)


def _engine_factory(model, tok, made: list):
    import copy

    from host.engine import Engine
    from host.engine.compute import compute

    def factory(pages):
        made.append(pages)
        return compute().call(lambda: Engine(copy.deepcopy(model), tok, kv_pages=pages, prefix_caching=False,
                                             suffix_tokens=0))
    return factory


def test_engine_replies_and_features_match_a_forward(tmp_path, target):
    """Issue 54 item 3: replies from the engine's batched passes (greedy, and a sampled shard),
    with each row's features and argmax read out of the same passes, are what a plain forward
    over prompt + reply gives; greedy replies are the argmax chain; the pool is sized once."""
    model, tok = target
    made = []
    cfg = _cfg(tmp_path, tokens=16 * 24, layers=[0, 1, 2], generator="engine", sample_every=2).resolved()
    seqs = T.generate(model, tok, PROMPTS[:16], cfg, tmp_path / "w1", engine_factory=_engine_factory(model, tok, made))
    assert len(made) == 1 and len(seqs) == 16 and [q["sampled"] for q in seqs] == [False] * 8 + [True] * 8
    plain = [{k: (v.tolist() if k == "ids" else v) for k, v in q.items() if k not in ("h", "choice", "feat")}
             for q in seqs]
    ref = T.capture(model, plain, dataclasses.replace(cfg, generator="hf"), tmp_path / "w2")
    differs = 0
    for a, b in zip(seqs, ref):
        L, P = len(a["ids"]), a["prompt_len"]
        assert a["h"].shape == (L - 1, 64) and a["feat"].shape == (L - 1, 3 * 64)
        torch.testing.assert_close(a["feat"].float(), b["feat"][:L - 1].float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(a["h"].float(), b["h"][:L - 1].float(), atol=2e-2, rtol=2e-2)
        assert torch.equal(a["choice"][P - 1:L - 1], b["choice"][P - 1:L - 1])
        assert (a["choice"][:P - 1] == -1).all()
        follows = torch.equal(a["choice"][P - 1:L - 1].long(), a["ids"][P:].long())
        assert follows or a["sampled"]
        differs += not follows
    assert differs > 0  # the sampled shard sampled
    again = T.generate(model, tok, PROMPTS[:16], cfg, tmp_path / "w1", engine_factory=None)  # shards reused
    assert all(torch.equal(x["ids"], y["ids"]) for x, y in zip(again, seqs))
    with pytest.raises(ValueError, match="other settings"):  # replies of another generator are not mixed in
        T.generate(model, tok, PROMPTS[:16], dataclasses.replace(cfg, generator="hf"), tmp_path / "w1")


def test_train_tiny_eagle3_head(tmp_path, monkeypatch, target):
    """Issue 54: a head of kind eagle3 trains on its layers' inputs (step 1) and its own output
    (chained steps), saves its kind and layers, and loads."""
    monkeypatch.setenv("PIE_HOME", str(tmp_path / "home"))
    model, tok = target
    res = T.train(model, tok, _cfg(tmp_path, tokens=400, epochs=4, eval_points=2, layers=[0, 1, 2]), prompts=PROMPTS)
    losses = [h["loss"] for h in res["history"]["train"]]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3
    spec = json.loads((tmp_path / "out" / "drafter.json").read_text())
    assert spec["kind"] == "eagle3" and spec["layers"] == [0, 1, 2]
    head, hs = load_head(tmp_path / "out", model)
    assert head.kind == "eagle3" and head.layers == (0, 1, 2) and head.fc.weight.shape == (64, 192)
    vals = [h["top1"] for h in res["history"]["val"]]
    assert vals[-1] > vals[0]  # it learned
    # a work folder made for an MTP head (no layer features) cannot feed an eagle3 head
    first = _cfg(tmp_path / "m", tokens=200, epochs=1, eval_points=1)
    T.train(model, tok, first, prompts=PROMPTS)
    with pytest.raises(ValueError, match="another --work-dir"):
        T.train(model, tok, dataclasses.replace(first, layers=[0, 1], out=tmp_path / "m" / "out2"), prompts=PROMPTS)


def test_soft_targets_are_the_targets_own_distribution_at_the_predicted_row(tmp_path, target):
    """Row j's soft target comes from h_{j+1}, the row where the target chose row j's label: its
    argmax through the target's final norm and lm_head is that label. The soft loss is the
    cross-entropy against that distribution, and is smallest (zero gradient) at the target's logits."""
    model, tok = target
    cfg = _cfg(tmp_path, tokens=200).resolved()
    seqs = T.generate(model, tok, PROMPTS[:8], cfg, tmp_path / "w")
    V = model.get_output_embeddings().weight.shape[0]
    vmap = torch.arange(V)
    bt = T.Batch(seqs, vmap, 2)
    W = model.get_output_embeddings().weight.detach()
    T_ = bt.T
    for s in (1, 2):
        lab = bt.raw[:, s - 1:T_ + s - 1]
        m = (lab != T.IGNORE) & bt.h_next_ok[:, s - 1:T_ + s - 1]
        hn = bt.h_next[:, s - 1:T_ + s - 1][m]
        with torch.no_grad():
            choice = torch.nn.functional.linear(model.get_decoder().norm(hn), W).argmax(-1)
        assert m.sum() > 50 and (choice == lab[m]).float().mean() > 0.95  # h stored in bfloat16
        shifted = (torch.nn.functional.linear(model.get_decoder().norm(bt.h[:, :T_][m]), W).argmax(-1) == lab[m])
        assert shifted.float().mean() < 0.9  # an off-by-one row would not match
    with torch.no_grad():
        ref = torch.nn.functional.linear(model.get_decoder().norm(hn), W)
    x = ref.clone().requires_grad_(True)
    loss = T._soft_ce(x, model, hn, W)
    loss.backward()
    p = torch.softmax(ref, -1)
    assert abs(float(loss.detach()) - float(-(p * torch.log_softmax(ref, -1)).sum(-1).mean())) < 1e-4
    assert float(x.grad.abs().max()) < 1e-5
    y = (ref + torch.randn_like(ref)).requires_grad_(True)
    assert float(T._soft_ce(y, model, hn, W).detach()) > float(loss.detach())


def test_confidence_stops_score_the_drafts_a_stopped_chain_proposes(tmp_path, target):
    """evaluate(stops=...): P = 0 proposes every step and accepts the expected accepted drafts;
    a P above every probability proposes nothing; in between, fewer drafts, never more accepted
    than proposed, and the stop only drops drafts (never accepts more than P = 0)."""
    from host.drafter.mtp import MtpHead

    model, tok = target  # a random head over 97 ids: its drafts' probabilities ~0.013 to 0.02
    seqs = T.generate(model, tok, PROMPTS[:8], _cfg(tmp_path, tokens=200).resolved(), tmp_path / "w")
    V = model.get_output_embeddings().weight.shape[0]
    torch.manual_seed(0)
    head = MtpHead(model, draft_vocab=torch.arange(V))
    W = head.output_weight(model.get_output_embeddings().weight).detach()
    with torch.no_grad():
        none = T.evaluate(head, model, seqs, torch.arange(V), W, 3, autocast=False)
        probs = T.evaluate(head, model, seqs, torch.arange(V), W, 1, autocast=False, stops=(0.0,))
        res = T.evaluate(head, model, seqs, torch.arange(V), W, 3, autocast=False, stops=(0.0, 0.015, 0.016, 1.01))
    assert "stops" not in none and len(probs["stops"]) == 1
    full, mid, mid2, never = res["stops"]
    assert full["drafts"] == pytest.approx(3.0) and full["accepted"] == pytest.approx(none["expected_accepted"][-1])
    assert never["drafts"] == never["accepted"] == 0.0
    assert 0 < mid2["drafts"] <= mid["drafts"] < 3.0
    assert all(x["accepted"] <= min(x["drafts"], full["accepted"]) + 1e-9 for x in res["stops"])


def test_train_tiny_head(tmp_path, monkeypatch, target):
    monkeypatch.setenv("PIE_HOME", str(tmp_path / "home"))
    model, tok = target
    res = T.train(model, tok, _cfg(tmp_path, context_share=0.4), prompts=PROMPTS)
    rounds = res["recipe"]["data"]["rounds"]
    assert rounds["first"]["sequences"] > 0 and rounds["second"]["sequences"] > 0  # tasks over its own replies
    assert (tmp_path / "work" / "gen-context").is_dir()
    out = tmp_path / "out"
    for f in ("head.safetensors", "drafter.json", "training.png", "RECIPE.md"):
        assert (out / f).exists(), f
    losses = [h["loss"] for h in res["history"]["train"]]
    assert len(losses) == res["steps"] >= 20
    # soft targets: the loss's floor is the entropy of the target's own distribution, near uniform
    # for a random tiny model, so it falls only a little; the top-1 below shows the learning
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3
    vals = [h["top1"] for h in res["history"]["val"]]
    assert len(vals) == 3 and vals[-1] > vals[0]
    v = res["validation"]
    assert 0.0 <= v["top1"] <= 1.0 and 0.0 <= v["top1_step2"] <= 1.0 and v["rows"] > 0
    ea = v["expected_accepted"]
    assert len(ea) == 4 and all(a <= b + 1e-9 for a, b in zip(ea, ea[1:])) and ea[-1] <= 4
    assert v["top1"] > 0.3  # a random tiny model's greedy replies are very predictable
    spec = json.loads((out / "drafter.json").read_text())
    assert spec["source"] == "trained" and spec["recipe"]["validation"]["top1"] == round(v["top1"], 4)
    assert spec["recipe"]["data"]["reply_tokens"] >= 800 and spec["draft_vocab_size"] <= 97
    head, hs = load_head(out, model)
    assert hs.name == "tiny-mtp" and head.draft_vocab is not None and len(head.draft_vocab) == spec["draft_vocab_size"]
    # the lm_head is shared, never stored
    from safetensors.torch import load_file
    keys = load_file(str(out / "head.safetensors")).keys()
    assert "head.weight" not in keys and "eh_proj.weight" in keys
    assert all(t.dtype == torch.bfloat16 for k, t in load_file(str(out / "head.safetensors")).items() if k != "draft_vocab")
    # nothing under $PIE_HOME was written
    assert not (tmp_path / "home").exists()


def test_resume_continues_from_checkpoint(tmp_path, monkeypatch, target):
    monkeypatch.setenv("PIE_HOME", str(tmp_path / "home"))
    model, tok = target
    cfg = _cfg(tmp_path, tokens=400, epochs=3, ckpt_every=4, eval_points=1)
    part = T.train(model, tok, T.TrainConfig(**{**cfg.__dict__, "stop_after": 7}), prompts=PROMPTS)
    assert part["interrupted"] and part["steps"] == 7 and (tmp_path / "work" / "ckpt.pt").exists()
    assert not (tmp_path / "out" / "head.safetensors").exists()
    gen = sorted((tmp_path / "work" / "gen").glob("shard_*.pt"))
    mtimes = [p.stat().st_mtime_ns for p in gen]
    done = T.train(model, tok, T.TrainConfig(**{**cfg.__dict__, "resume": True}), prompts=PROMPTS)
    # generation and features came from the work folder
    assert [p.stat().st_mtime_ns for p in gen] == mtimes
    assert done["recipe"]["time_s"]["generate"] < 1.0
    steps = [h["step"] for h in done["history"]["train"]]
    assert steps == list(range(1, done["steps"] + 1)) and done["steps"] > 7
    # the resumed run ends where an uninterrupted one does
    full = T.train(model, tok, _cfg(tmp_path / "b", tokens=400, epochs=3, ckpt_every=4, eval_points=1), prompts=PROMPTS)
    assert [round(h["loss"], 4) for h in full["history"]["train"]] == [round(h["loss"], 4) for h in done["history"]["train"]]
    assert abs(full["validation"]["top1"] - done["validation"]["top1"]) < 1e-6


def test_a_budget_stops_the_run_checkpointed_and_resume_ends_as_an_uninterrupted_one(tmp_path, monkeypatch, target):
    """--budget-minutes: at the budget the run stops at the next shard or step, checkpointed; a
    checkpoint is also written every ckpt_s of the budget's clock. The clock is a counter here: one
    second a reading."""
    monkeypatch.setenv("PIE_HOME", str(tmp_path / "home"))
    model, tok = target
    cfg = _cfg(tmp_path, tokens=400, epochs=3, ckpt_every=1000, eval_points=1)
    none = T.train(model, tok, T.TrainConfig(**{**cfg.__dict__, "budget_s": 0.0}), prompts=PROMPTS)
    assert none["interrupted"] and none["steps"] == 0 and not list((tmp_path / "work" / "gen").glob("shard_*"))
    ticks = iter(range(10**6))
    monkeypatch.setattr(T, "_now", lambda: float(next(ticks)))
    saves = []
    real_save = T._save_atomic
    monkeypatch.setattr(T, "_save_atomic", lambda obj, path: (saves.append(Path(path).name), real_save(obj, path)))
    part = T.train(model, tok, T.TrainConfig(**{**cfg.__dict__, "budget_s": 40.0, "ckpt_s": 5.0}), prompts=PROMPTS)
    assert part["interrupted"] and 0 < part["steps"] < 3 * 40 and (tmp_path / "work" / "ckpt.pt").exists()
    assert saves.count("ckpt.pt") >= 2  # by the clock (ckpt_every is past the run's steps), and at the stop
    assert not (tmp_path / "out" / "head.safetensors").exists()
    monkeypatch.undo()
    monkeypatch.setenv("PIE_HOME", str(tmp_path / "home"))
    done = T.train(model, tok, T.TrainConfig(**{**cfg.__dict__, "resume": True}), prompts=PROMPTS)
    full = T.train(model, tok, _cfg(tmp_path / "b", tokens=400, epochs=3, ckpt_every=1000, eval_points=1),
                   prompts=PROMPTS)
    assert [round(h["loss"], 4) for h in full["history"]["train"]] == [round(h["loss"], 4) for h in done["history"]["train"]]


def test_cli_parser(tmp_path, monkeypatch):
    import argparse

    from host.cli import drafter as train_cli

    monkeypatch.setenv("PIE_HOME", str(tmp_path / "home"))
    parser = argparse.ArgumentParser(prog="pie drafter")
    train_cli.add_parser(parser.add_subparsers(dest="drafter_command", required=True))
    args = parser.parse_args(["train", "smollm2-135m", "--name", "h", "--tokens", "5000", "--epochs", "2",
                              "--lr", "5e-4", "--draft-vocab", "4096", "--seed", "3", "--batch", "4", "--resume",
                              "--max-new-tokens", "64", "--work-dir", str(tmp_path / "w")])
    assert args.func is train_cli.run and args.name == "h" and args.tokens == 5000 and args.resume
    assert (args.epochs, args.lr, args.draft_vocab, args.seed, args.batch, args.max_new_tokens) == (2, 5e-4, 4096, 3, 4, 64)
    assert args.kind == "mtp" and args.layers is None
    args = parser.parse_args(["train", "m", "--name", "h", "--kind", "eagle3", "--layers", "2,15,27"])
    assert (args.kind, args.layers) == ("eagle3", "2,15,27")
    assert parser.parse_args(["train", "m", "--name", "h", "--budget-minutes", "45"]).budget_minutes == 45
    cfg = T.TrainConfig(name="h").resolved()
    assert cfg.out == tmp_path / "home" / "drafters" / "h" and cfg.work_dir == tmp_path / "home" / "drafters" / "h.work"
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert train_cli._resolve_model(str(folder)) == folder

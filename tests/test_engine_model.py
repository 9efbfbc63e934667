"""Greedy decoding through the engine equals HF generate on the real default model (float32)."""

from __future__ import annotations

import pytest

from host.engine import Pass

pytestmark = pytest.mark.model
NEW = 32


def engine_greedy(engine, prompts: list[list[int]], n: int, eos: set[int]) -> list[list[int]]:
    """Plain autoregressive greedy decoding, all prompts in one batch per step."""
    wss = [engine.new_working_set() for _ in prompts]
    outs: list[list[int]] = [[] for _ in prompts]
    live = {i: Pass(ws, list(p), [len(p) - 1]) for i, (ws, p) in enumerate(zip(wss, prompts))}
    try:
        for _ in range(n):
            if not live:
                break
            idx = list(live)
            results = engine.forward([live[i] for i in idx])
            for i, r in zip(idx, results):
                assert not isinstance(r, Exception), r
                tok = int(r.logits[-1].argmax())
                outs[i].append(tok)
                live[i] = Pass(wss[i], [tok], [0])
                if tok in eos:
                    del live[i]
    finally:
        for ws in wss:
            engine.release(ws)
    return outs


def test_greedy_equals_hf_generate_on_every_dev_prompt(engine, chat_ids, hf_greedy):
    eos = set(engine.info.eos_ids)
    free = engine.pool.free_pages
    mismatches = []
    for i, ids in enumerate(chat_ids):
        (ours,) = engine_greedy(engine, [ids], NEW, eos)
        if ours != hf_greedy(i, NEW):
            mismatches.append(i)
    assert not mismatches, f"dev prompts whose greedy tokens differ from HF generate: {mismatches}"
    assert engine.pool.free_pages == free


def test_batch_of_8_equals_hf_generate(engine, chat_ids, hf_greedy):
    picks = list(range(0, 46, 6))[:8]
    outs = engine_greedy(engine, [chat_ids[i] for i in picks], NEW, set(engine.info.eos_ids))
    for i, ours in zip(picks, outs):
        assert ours == hf_greedy(i, NEW), f"dev prompt {i} differs in a batch of 8"

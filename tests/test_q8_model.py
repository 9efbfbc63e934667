"""The default model imported with 8-bit activations (`pie model import smollm2-135m --activations
q8`): another arithmetic (other outputs than the exact model's: tests/test_weights.py), yet
lossless speculation within it. cacheback, MTP and the hybrid give its plain decoding's tokens on dev prompts; seeded sampling
repeats."""

from __future__ import annotations

import pytest

from conftest import dev_prompts
from wasm_fixtures import TEST_CACHE, build_inferlet
from wasm_fixtures import *  # noqa: F401,F403 (fixtures)

pytestmark = [pytest.mark.wasm, pytest.mark.model]

N = 48
PROMPTS = (0, 21, 40)  # dev prompts of several categories


@pytest.fixture(scope="module")
def q8_runtime():
    from host import store
    from host.runtime import Runtime

    rec, _ = store.import_model(store.DEFAULT_MODEL, progress=False, activations="q8")
    assert rec.activations == "q8" and rec.drafters
    rt = Runtime(store.open_engine(rec.name, dtype="float32", device="cpu", kv_pages=256), cache_dir=TEST_CACHE)
    yield rt
    rt.close()


def _args(prompt: str, *extra: str) -> list[str]:
    return ["--prompt", prompt, "--chat", "--max-tokens", str(N), *extra]


def test_speculative_inferlets_give_plain_decodings_tokens(q8_runtime, text_completion_wasm):
    cacheback, mtp = build_inferlet("cacheback-speculative-decoding"), build_inferlet("mtp-speculative-decoding")
    drafter = q8_runtime.engine.info.drafters[0]
    prompts = [dev_prompts()[i]["prompt"] for i in PROMPTS]
    contenders = {"text-completion": (text_completion_wasm, ()), "cacheback": (cacheback, ()), "mtp": (mtp, ()),
                  "hybrid": (cacheback, ("--drafter", drafter))}
    handles = {name: [q8_runtime.start(w, _args(p, *extra)) for p in prompts] for name, (w, extra) in contenders.items()}
    runs = {name: [h.result(timeout=900) for h in hs] for name, hs in handles.items()}
    plain = [r.token_ids for r in runs.pop("text-completion")]
    assert all(len(t) == N for t in plain)
    for name, results in runs.items():
        assert [r.token_ids for r in results] == plain, name
    assert sum(r.stats["accepted_tokens"] for r in runs["hybrid"]) > 0


def test_seeded_sampling_repeats(q8_runtime):
    """With the head's drafts (cacheback's would come from the first run's output, in its
    namespace's suffix index: other drafts, another draw sequence)."""
    mtp = build_inferlet("mtp-speculative-decoding")
    args = _args(dev_prompts()[3]["prompt"], "--temperature", "0.9", "--seed", "7")
    first, second, other = (q8_runtime.start(mtp, a).result(timeout=900) for a in (args, args, args[:-1] + ["8"]))
    assert first.token_ids == second.token_ids and first.token_ids
    assert other.token_ids != first.token_ids


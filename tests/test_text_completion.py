"""text-completion through Wasm: greedy equals HF generate; seeded sampling repeats; batching is invisible."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import dev_prompts
from wasm_fixtures import ROOT
from wasm_fixtures import *  # noqa: F401,F403 (fixtures)

pytestmark = [pytest.mark.wasm, pytest.mark.model]

N = 32
WAVE = 16


def _args(prompt: str, n: int = N, *extra: str) -> list[str]:
    return ["--prompt", prompt, "--chat", "--max-tokens", str(n), *extra]


def test_guest_chat_prompt_matches_the_reference_ids(engine, chat_ids):
    # the guest encodes the template text without added special tokens
    tok = engine.tokenizer
    for p, ids in zip(dev_prompts(), chat_ids):
        text = tok.apply_chat_template([{"role": "user", "content": p["prompt"]}], tokenize=False,
                                       add_generation_prompt=True)
        assert tok.encode(text, add_special_tokens=False) == ids


@pytest.mark.parametrize("loop", ["device", "guest"])
def test_greedy_equals_hf_generate_on_every_dev_prompt(runtime, engine, text_completion_wasm, hf_greedy, loop):
    prompts = dev_prompts()
    refs = [hf_greedy(i, N) for i in range(len(prompts))]
    # in concurrent waves, so the engine batches them into shared model calls
    results = []
    for start in range(0, len(prompts), WAVE):
        handles = [runtime.start(text_completion_wasm, _args(p["prompt"], N, "--loop", loop))
                   for p in prompts[start:start + WAVE]]
        results += [h.result(timeout=600) for h in handles]
    for i, (r, ref) in enumerate(zip(results, refs)):
        assert r.ok, r.error
        assert r.token_ids == ref, f"dev prompt {i} (id {prompts[i]['id']}), --loop {loop}"
        assert r.text == engine.tokenizer.decode(ref, skip_special_tokens=True)
        # one pass per token in both modes: the prompt's pass makes the first
        assert r.stats["passes"] == len(ref)


def test_device_loop_equals_guest_loop_in_bfloat16(text_completion_wasm):
    # In reduced precision a matrix product's rounding depends on its row count, so the two loops
    # agree only because both run the prompt as one pass and each later token as a one-row pass.
    # On a bfloat16 CPU, prefilling the prompt's head apart from its last token changed these dev
    # prompts' greedy tokens within their first eight.
    from host import store
    from host.runtime import Runtime
    from wasm_fixtures import TEST_CACHE

    prompts = {p["id"]: p["prompt"] for p in dev_prompts()}
    engine = store.open_engine(dtype="bfloat16", device="cpu", kv_pages=256)
    with Runtime(engine, cache_dir=TEST_CACHE) as rt:
        for i in (81, 91, 326, 483):
            got = {loop: rt.run(text_completion_wasm, _args(prompts[i], 12, "--loop", loop)) for loop in ("device", "guest")}
            assert all(r.ok for r in got.values()), [r.error for r in got.values()]
            assert got["device"].token_ids == got["guest"].token_ids, f"dev prompt {i}"


def test_device_loop_takes_almost_no_guest_calls(runtime, text_completion_wasm):
    r = runtime.run(text_completion_wasm, ["--prompt", "The history of the city begins", "--max-tokens", "240"])
    assert r.ok, r.error
    assert r.stats["generated_tokens"] == 240  # a plain-text prompt: the model writes on
    assert r.stats["guest_calls"] / r.stats["generated_tokens"] < 0.1
    g = runtime.run(text_completion_wasm, ["--prompt", "The history of the city begins", "--max-tokens", "240",
                                           "--loop", "guest"])
    assert g.token_ids == r.token_ids and g.stats["guest_calls"] > 240


def test_text_streams_as_generated(runtime, text_completion_wasm, engine):
    chunks: list[str] = []
    r = runtime.run(text_completion_wasm, _args("Name three fruits.", 24), on_text=chunks.append)
    assert r.ok, r.error
    assert len(chunks) > 3
    assert "".join(chunks) == r.text == engine.tokenizer.decode(r.token_ids, skip_special_tokens=True)


@pytest.mark.parametrize("fast", [True, False])
def test_detokenizer_streams_the_full_decode(engine, fast):
    # both paths (DecodeStream, and two decodes per push): chunks join to the full decode, a
    # character split across tokens waits for its last byte, special tokens are skipped, and
    # finish() flushes an incomplete tail as the full decode has it
    from host.runtime.detok import Detokenizer
    tok = engine.tokenizer
    ids = tok("Hi wörld 😀 naïve — Привет, 世界!\n  x", add_special_tokens=False)["input_ids"]
    ids = ids + [tok.eos_token_id] + ids
    emoji = tok("😀", add_special_tokens=False)["input_ids"]
    assert len(emoji) > 1  # a byte-level split: the case the hold-back is for
    for tail in ([], emoji[:1]):
        d = Detokenizer(tok)
        if not fast:
            d._stream = None
        cuts = list(range(0, len(ids), 3)) + [len(ids)]  # pushes of one and two ids
        cuts = sorted(set(cuts) | {c + 1 for c in cuts[:-1]})
        chunks = [d.push(ids[a:b]) for a, b in zip(cuts, cuts[1:])]
        chunks.append(d.push(tail))
        chunks.append(d.finish())
        assert "".join(chunks) == tok.decode(ids + tail, skip_special_tokens=True)
        assert not any(c.endswith("\ufffd") for c in chunks[:-1])


@pytest.mark.parametrize("streaming", [True, False])
def test_output_text_keeps_the_order_of_emits_and_sends(engine, streaming):
    # without a streaming client, emitted ids are decoded only when text is needed: a send
    # between two emits still lands between their texts, as it does when streaming
    from host.runtime.bindings import InstanceHost
    tok = engine.tokenizer
    a = tok("Hello wörld", add_special_tokens=False)["input_ids"]
    b = tok(" and 😀 more", add_special_tokens=False)["input_ids"]
    chunks = []
    host = InstanceHost(engine, None, [], 10.0, 0.01, on_text=chunks.append if streaming else None)
    host.emit(a)
    host.send("|sent|")
    host.emit(b[:1])
    host.emit(b[1:])
    host.finish_output()
    want = tok.decode(a, skip_special_tokens=True) + "|sent|" + tok.decode(b, skip_special_tokens=True)
    assert host.text == want and host.token_ids == a + b
    assert "".join(chunks) == (want if streaming else "")


SAMPLED = ("--temperature", "0.9", "--top-p", "0.95", "--seed", "1234")


def test_seeded_sampling_repeats_exactly(runtime, text_completion_wasm):
    prompt = dev_prompts()[0]["prompt"]
    a = runtime.run(text_completion_wasm, _args(prompt, 24, *SAMPLED))
    b = runtime.run(text_completion_wasm, _args(prompt, 24, *SAMPLED))
    other = runtime.run(text_completion_wasm, _args(prompt, 24, "--temperature", "0.9", "--top-p", "0.95",
                                                    "--seed", "99"))
    assert a.ok and b.ok and other.ok
    assert a.token_ids == b.token_ids
    assert other.token_ids != a.token_ids  # a different seed draws differently


@pytest.mark.parametrize("sampled", [SAMPLED, ("--temperature", "0.7", "--seed", "5")])
def test_seeded_sampling_is_the_same_in_the_guest_and_device_loops(runtime, text_completion_wasm, sampled):
    """One sampling rule, draws keyed by seed and position: the guest's sampler (one pass per
    token) and the device loop's epilogue draw the same tokens."""
    prompt = dev_prompts()[1]["prompt"]
    guest = runtime.run(text_completion_wasm, _args(prompt, 24, *sampled, "--loop", "guest"))
    device = runtime.run(text_completion_wasm, _args(prompt, 24, *sampled, "--loop", "device"))
    assert guest.ok and device.ok, (guest.error, device.error)
    assert guest.token_ids == device.token_ids and len(guest.token_ids) > 4


def test_concurrent_instances_get_the_same_tokens_as_alone(runtime, text_completion_wasm):
    prompts = [p["prompt"] for p in dev_prompts()[:4]]
    runs = [_args(prompts[0], 20), _args(prompts[1], 20, *SAMPLED), _args(prompts[2], 20),
            _args(prompts[3], 20, "--temperature", "0.7", "--seed", "5")]
    alone = [runtime.run(text_completion_wasm, a).token_ids for a in runs]
    handles = [runtime.start(text_completion_wasm, a) for a in runs]
    together = [h.result(timeout=300) for h in handles]
    assert all(r.ok for r in together)
    assert [r.token_ids for r in together] == alone


def test_pie_run_json(hf_greedy, text_completion_wasm):
    prompt = dev_prompts()[0]["prompt"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "host.cli", "run", "text-completion", "--dtype", "float32", "--device", "cpu",
         "--json", "--", *_args(prompt, 8)],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)  # exactly one JSON object, nothing else on stdout
    assert set(out) == {"inferlet", "model", "text", "token_ids", "stats"}
    assert out["inferlet"] == "text-completion" and out["model"] == "smollm2-135m"
    assert out["token_ids"] == hf_greedy(0, 8)
    assert set(out["stats"]) == {"passes", "generated_tokens", "drafted_tokens", "accepted_tokens", "acceptance_by_position",
                                 "mean_accepted_per_pass", "finish", "guest_calls", "cached_tokens", "wall_s",
                                 "tokens_per_s"}
    assert out["stats"]["cached_tokens"] == 0  # a fresh process: nothing cached yet

"""windowed-attention: generation past the model's context length in bounded KV pages, and the
tokens of plain decoding (text-completion) until the first eviction. On the tiny model
(context 128, pages of 4 rows), so a long generation is quick."""

from __future__ import annotations

import pytest

from wasm_fixtures import TEST_CACHE, build_inferlet

pytestmark = [pytest.mark.wasm]

PROMPT = ["--prompt", "hello"]  # 5 tokens on the tiny tokenizer
SMALL = {"sinks": 4, "window": 24, "step": 8}  # at most 36 rows; sinks fill page 0 exactly


def _policy(**policy) -> list[str]:
    return [a for k, v in policy.items() for a in (f"--{k}", str(v))]


def _args(max_tokens: int, **policy) -> list[str]:
    return [*PROMPT, "--max-tokens", str(max_tokens), *_policy(**policy)]


@pytest.fixture(scope="module")
def wasm():
    return build_inferlet("windowed-attention"), build_inferlet("text-completion")


@pytest.fixture(scope="module")
def runtime():
    from host.conformance.models import suite_model
    from host.engine import Engine
    from host.runtime import Limits, Runtime

    m = suite_model("tiny")
    engine = Engine(m.model, m.tokenizer, name="tiny", kv_pages=m.kv_pages, page_size=m.page_size)
    with Runtime(engine, cache_dir=TEST_CACHE, limits=Limits(kv_share=1.0)) as rt:  # pages are measured, not capped
        yield rt


@pytest.fixture
def peak_pages(runtime, monkeypatch):
    """The most pages the pool had in use at once during the test."""
    pool = runtime.engine.pool
    peak = [pool.used_pages]
    alloc = pool.alloc

    def counted(*a, **k):
        pages = alloc(*a, **k)
        peak[0] = max(peak[0], pool.used_pages)
        return pages

    monkeypatch.setattr(pool, "alloc", counted)
    return peak


def test_equal_to_plain_decoding_while_nothing_is_evicted(runtime, wasm):
    windowed, plain = wasm
    want = runtime.run(plain, _args(100))  # 105 rows: under the default cap (the whole context, 128)
    got = runtime.run(windowed, _args(100))
    assert want.ok and got.ok, (want.error, got.error)
    assert len(want.token_ids) == 100 and got.token_ids == want.token_ids
    assert got.text == want.text


def test_equal_to_plain_decoding_up_to_the_first_eviction(runtime, wasm):
    windowed, plain = wasm
    cap = sum(SMALL.values())
    first = cap - 5 + 1  # the tokens of the passes up to row `cap`: the prompt's pass and one per row after it
    want = runtime.run(plain, _args(60))
    got = runtime.run(windowed, _args(60, **SMALL))
    assert want.ok and got.ok, (want.error, got.error)
    assert got.token_ids[:first] == want.token_ids[:first]
    assert len(got.token_ids) == 60


def test_runs_past_the_context_length_in_bounded_pages(runtime, wasm, peak_pages):
    windowed, plain = wasm
    context, page = runtime.engine.info.context_len, runtime.engine.pool.page_size
    n = 3 * context
    r = runtime.run(windowed, _args(n, **SMALL))
    assert r.ok, r.error
    assert len(r.token_ids) == n and r.stats["generated_tokens"] == n
    # the cap's pages, plus those an eviction allocates for the window's rows before it frees the old ones
    cap_pages = -(-sum(SMALL.values()) // page)
    bound = cap_pages + -(-SMALL["window"] // page)
    assert peak_pages[0] <= bound < (5 + n) // page
    assert runtime.engine.pool.used_pages == 0  # everything went back at the end
    plain_run = runtime.run(plain, _args(n))  # plain decoding stops at the context
    assert not plain_run.ok and "context-overflow" in plain_run.error


def test_a_long_prompt_is_prefilled_in_pieces(runtime, wasm, peak_pages):
    windowed, _ = wasm
    page = runtime.engine.pool.page_size
    r = runtime.run(windowed, ["--prompt", "abcdefghij" * 20, "--max-tokens", "20", *_policy(**SMALL)])
    assert r.ok, r.error  # a 200-token prompt, past the context of 128
    assert len(r.token_ids) == 20
    assert peak_pages[0] <= -(-sum(SMALL.values()) // page) + -(-SMALL["window"] // page)


def test_a_policy_past_the_context_is_refused(runtime, wasm):
    r = runtime.run(wasm[0], _args(4, sinks=4, window=100, step=32))
    assert not r.ok
    assert "--sinks 4 + --window 100 + --step 32 exceed the model's context of 128 rows" in r.error

"""Automatic prefix caching (issue 43): a pass over an empty working set takes the cached pages of
its window's leading blocks, and the rows it then computes, the logits it reads out and every
token after are the bits a fresh prefill gives (the engine's rows do not depend on the rows
computed beside them); blocks are found only in their own namespace; pages only the cache holds
count against no quota and are reclaimed under pressure; a write into a shared page copies it."""

from __future__ import annotations

import pytest
import torch

from host.engine import Engine, Pass
from host.engine.pages import PagePool
from host.errors import PoolExhausted, QuotaExhausted
from wasm_fixtures import *  # noqa: F401,F403 (fixtures)

PROMPT = list(range(5, 42))  # 37 tokens: 9 full blocks of 4 and one more token


def engine(prefix_caching=True, kv_pages=64):
    from transformers import LlamaForCausalLM

    from host.conformance.models import TinyTokenizer, tiny_config

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config()).eval()
    return Engine(model, TinyTokenizer(), name="tiny", kv_pages=kv_pages, page_size=4, prefix_caching=prefix_caching)


def greedy(eng, prompt, n=10, **ws_kw):
    """(tokens, the prompt pass's last logits row, the working set's cached rows) of plain greedy decoding."""
    ws = eng.new_working_set(**ws_kw)
    (out,) = eng.forward([Pass(ws, prompt, [len(prompt) - 1])])
    first, toks = out.logits[-1].clone(), []
    for _ in range(n):
        toks.append(int(out.logits[-1].argmax()))
        (out,) = eng.forward([Pass(ws, [toks[-1]], [0])])
    eng.release(ws)
    return toks, first, ws.cached_tokens


@pytest.fixture(scope="module")
def plain():
    """What a fresh prefill gives, per prompt (an engine without the cache)."""
    eng, memo = engine(prefix_caching=False), {}

    def get(prompt, n=10):
        key = (tuple(prompt), n)
        if key not in memo:
            memo[key] = greedy(eng, prompt, n)
        return memo[key]
    return get


def test_on_by_default_where_rows_are_independent():
    eng = engine(prefix_caching=None)
    assert eng.rows_independent and eng.prefix is not None


def test_a_repeated_prompt_attaches_its_blocks_with_the_same_bits(plain):
    eng = engine()
    want, want_row, _ = plain(PROMPT)
    toks, row, cached = greedy(eng, PROMPT)
    assert cached == 0 and toks == want and torch.equal(row, want_row)
    toks, row, cached = greedy(eng, PROMPT)
    assert cached == 36  # every full block before the readout row
    assert toks == want and torch.equal(row, want_row)
    # a conversation's next turn: the prompt, the answer and more; its answer's blocks were cached too
    longer = PROMPT + want[:7] + [3, 4]
    toks, row, cached = greedy(eng, longer, 6)
    assert cached == 44 and (toks, row) == (plain(longer, 6)[0], row) and torch.equal(row, plain(longer, 6)[1])
    assert eng.prefix.hits == 80 and eng.prefix.queries == 2 * len(PROMPT) + len(longer)
    assert eng.pool.used_pages == 0  # the cache's pages are free for the taking


def test_readout_rows_are_computed():
    eng = engine()
    greedy(eng, PROMPT, 1)
    for readout, attached in (([10], 8), ([0, 36], 0), ([], 36)):
        ws = eng.new_working_set()
        eng.forward([Pass(ws, PROMPT, readout)])
        assert ws.cached_tokens == attached, readout
        eng.release(ws)


def test_blocks_are_found_only_in_their_namespace():
    eng = engine()
    greedy(eng, PROMPT, 1, namespace="alice")
    assert greedy(eng, PROMPT, 1, namespace="bob")[2] == 0
    assert greedy(eng, PROMPT, 1, namespace="alice")[2] == 36
    assert greedy(eng, PROMPT, 1, namespace="bob")[2] == 36


def test_a_working_set_can_opt_out():
    eng = engine()
    greedy(eng, PROMPT, 1, prefix_caching=False)
    assert len(eng.prefix) == 0
    greedy(eng, PROMPT, 1)
    assert greedy(eng, PROMPT, 1, prefix_caching=False)[2] == 0


def test_a_write_into_a_shared_page_copies_it(plain):
    eng = engine()
    want = plain(PROMPT)[0]
    greedy(eng, PROMPT)
    ws = eng.new_working_set()
    eng.forward([Pass(ws, PROMPT, [36])])
    assert ws.cached_tokens == 36
    eng.truncate(ws, 30)  # inside a cached block: the next pass writes into that page
    (out,) = eng.forward([Pass(ws, PROMPT[30:], [6])])
    assert int(out.logits[-1].argmax()) == want[0]
    eng.release(ws)
    assert greedy(eng, PROMPT)[0] == want  # the cached page kept its rows


def test_cached_pages_count_against_nobody_and_are_reclaimed_under_pressure(plain):
    eng = engine(kv_pages=16)
    pool = eng.pool
    quota = pool.quota(0.75)  # 12 pages
    want = plain(PROMPT, 3)[0]
    assert greedy(eng, PROMPT, 3, quota=quota)[0] == want
    assert quota.used == 0 and pool.used_pages == 0 and len(eng.prefix) == 10
    # attaching charges the pages to the attaching set's quota; what it cannot take, it computes
    small = pool.quota(0.25)  # 4 pages
    ws = eng.new_working_set(quota=small)
    (err,) = eng.forward([Pass(ws, PROMPT, [36])])  # 4 pages attached, and the other 21 rows need 6 more
    assert isinstance(err, QuotaExhausted)
    assert small.used == 0 and ws.pages == [] and ws.cached_tokens == 0  # nothing kept from the failed pass
    eng.release(ws)
    # under pressure, the pages only the cache holds are taken back (least recently used first)
    other = [9] * 60  # 15 pages
    toks, _, cached = greedy(eng, other, 1)
    assert cached == 0 and toks == plain(other, 1)[0]
    assert pool.used_pages == 0 and len(eng.prefix) <= 16


def test_pool_reclaim_frees_only_pages_nobody_holds():
    pool = PagePool(4, 2)
    pages = pool.alloc(2)
    pool.retain(pages)
    pool.cached.update(pages)
    pool.release([pages[0]])  # pages[0]: only the cache holds it now
    assert pool.free_pages == 3 and pool.used_pages == 1
    freed = []

    def reclaim(n):  # as the cache's: only a page nobody else holds
        freed.append(n)
        if pages[0] not in pool.cached:
            return 0
        pool.cached.discard(pages[0])
        pool.release([pages[0]])
        return 1
    pool.reclaim = reclaim
    assert len(pool.alloc(3)) == 3 and freed == [1]
    with pytest.raises(PoolExhausted):  # pages[1] is held by more than the cache: not taken
        pool.alloc(1)


# --- through Wasm on the default model ----------------------------------------------------

@pytest.mark.wasm
@pytest.mark.model
def test_inferlets_reuse_prompts_with_the_same_output(runtime, text_completion_wasm):
    """The second run of a prompt takes its blocks from the cache (text-completion's device loop:
    the prompt pass is its first round; the guest loop; cacheback's prefill pass) and writes the
    same tokens, greedy and seeded sampled (draws are keyed by the window's first position, which
    the cache does not move); a run outside the cache computes everything and agrees."""
    from conftest import dev_prompts
    from wasm_fixtures import build_inferlet  # noqa: F811

    cacheback = build_inferlet("cacheback-speculative-decoding")
    prompt = dev_prompts()[5]["prompt"]
    base = ["--prompt", prompt, "--chat", "--max-tokens", "16"]
    for wasm, extra in ((text_completion_wasm, []), (text_completion_wasm, ["--loop", "guest"]), (cacheback, []),
                        (text_completion_wasm, ["--temperature", "0.8", "--seed", "5"])):
        alone = runtime.run(wasm, base + extra, prefix_caching=False)
        assert alone.ok and alone.stats["cached_tokens"] == 0, alone.error
        first, again = (runtime.run(wasm, base + extra) for _ in range(2))
        assert first.ok and again.ok, (first.error, again.error)
        assert again.stats["cached_tokens"] >= 16, extra
        assert first.token_ids == again.token_ids == alone.token_ids, extra

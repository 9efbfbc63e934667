"""The engine against transformers' own forward on a tiny random Llama (fp32, exact to 1e-4)."""

from __future__ import annotations

import pytest
import torch

from host.engine import Pass
from host.errors import BadHandle, ContextOverflow, InvalidArgument, PoolExhausted

TOL = 1e-4


def ref_logits(ref, seq: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return ref(torch.tensor([seq])).logits[0]


def run(eng, *passes):
    out = eng.forward(list(passes))
    for o in out:
        if isinstance(o, Exception):
            raise o
    return out


def seq(n, start=3):
    return [(start + 7 * i) % 90 + 3 for i in range(n)]


def test_mixed_batch_matches_transformers(tiny):
    eng, ref = tiny
    a, b, c = eng.new_working_set(), eng.new_working_set(), eng.new_working_set()
    sa, sb, sc = seq(9, 1), seq(3, 2), seq(6, 5)
    run(eng, Pass(b, sb, [2]), Pass(c, sc[:2], [0, 1]))
    # prefill (a), single-row decode (b), multi-row window (c), all in one call
    oa, ob, oc = run(eng, Pass(a, sa, list(range(9))), Pass(b, [11], [0]), Pass(c, sc[2:], [0, 1, 2, 3]))
    assert torch.allclose(oa.logits, ref_logits(ref, sa), atol=TOL)
    assert torch.allclose(ob.logits[0], ref_logits(ref, sb + [11])[-1], atol=TOL)
    assert torch.allclose(oc.logits, ref_logits(ref, sc)[2:], atol=TOL)
    # a fork decoding next to its parent, and a truncated set, in one batch
    d = eng.fork(a)
    eng.truncate(c, 3)
    oa2, od, oc2 = run(eng, Pass(a, [20, 21], [0, 1]), Pass(d, [30], [0]), Pass(c, [40], [0]))
    assert torch.allclose(oa2.logits, ref_logits(ref, sa + [20, 21])[-2:], atol=TOL)
    assert torch.allclose(od.logits[0], ref_logits(ref, sa + [30])[-1], atol=TOL)
    assert torch.allclose(oc2.logits[0], ref_logits(ref, sc[:3] + [40])[-1], atol=TOL)


def test_a_batch_of_equal_windows_matches_transformers(tiny):
    """Equal windows over different contexts (batched decode, batched verification): the queries
    are taken in place, without the padded gather."""
    eng, ref = tiny
    sets = [eng.new_working_set() for _ in range(3)]
    prompts = [seq(5, 1), seq(11, 2), seq(2, 3)]
    run(eng, *[Pass(ws, p, [0]) for ws, p in zip(sets, prompts)])
    for window in ([40], [41, 42, 43]):
        outs = run(eng, *[Pass(ws, window, list(range(len(window)))) for ws in sets])
        for i, (o, p) in enumerate(zip(outs, prompts)):
            prompts[i] = p + window
            assert torch.allclose(o.logits, ref_logits(ref, prompts[i])[-len(window):], atol=TOL)
    for ws in sets:
        eng.release(ws)


def test_readout_chooses_rows_and_hidden(tiny):
    eng, ref = tiny
    ws = eng.new_working_set()
    s = seq(7)
    (o,) = run(eng, Pass(ws, s, [1, 5], hidden=True))
    assert o.logits.shape == (2, 97) and o.hidden.shape == (2, 64)
    full = ref_logits(ref, s)
    assert torch.allclose(o.logits, full[[1, 5]], atol=TOL)


def test_fold_freezes_exactly_m_rows_and_scratch_is_overwritten(tiny):
    eng, ref = tiny
    ws = eng.new_working_set()
    s = seq(5)
    run(eng, Pass(ws, s, [4]))
    # window of 4 drafts, only 1 accepted: the 3 scratch rows must never be attended
    run(eng, Pass(ws, [50, 51, 52, 53], [0, 1, 2, 3], fold=1))
    assert ws.frozen == 6 and ws.tokens == s + [50]
    (o,) = run(eng, Pass(ws, [60, 61], [0, 1], fold=0))
    assert ws.frozen == 6
    assert torch.allclose(o.logits, ref_logits(ref, s + [50, 60, 61])[-2:], atol=TOL)
    (o,) = run(eng, Pass(ws, [70], [0], fold=1))
    assert torch.allclose(o.logits[0], ref_logits(ref, s + [50, 70])[-1], atol=TOL)
    assert ws.frozen == 7


def test_fork_isolation(tiny):
    eng, ref = tiny
    parent = eng.new_working_set()
    s = seq(6)  # page size 4: the fork shares a partly filled page
    run(eng, Pass(parent, s, [5]))
    child = eng.fork(parent)
    run(eng, Pass(child, [80, 81, 82], [2]))
    (op,) = run(eng, Pass(parent, [90], [0]))
    assert torch.allclose(op.logits[0], ref_logits(ref, s + [90])[-1], atol=TOL)
    (oc,) = run(eng, Pass(child, [83], [0]))
    assert torch.allclose(oc.logits[0], ref_logits(ref, s + [80, 81, 82, 83])[-1], atol=TOL)
    assert parent.tokens == s + [90] and child.tokens == s + [80, 81, 82, 83]


def test_release_returns_pages(tiny):
    eng, _ = tiny
    free = eng.pool.free_pages
    a = eng.new_working_set()
    run(eng, Pass(a, seq(10), [0]))
    b = eng.fork(a)
    run(eng, Pass(b, [5], [0]))
    eng.release(a)
    eng.release(b)
    assert eng.pool.free_pages == free


def test_evict_keeps_surviving_rows(tiny):
    eng, ref = tiny
    ws = eng.new_working_set()
    s = seq(11)
    run(eng, Pass(ws, s, [0]))
    before = eng.kv[:, :, :, torch.tensor(ws.slots(0, 11))].clone()
    eng.evict(ws, 2, 7)
    assert ws.frozen == 6 and ws.tokens == s[:2] + s[7:]
    assert ws.positions == [0, 1, 7, 8, 9, 10] and ws.next_position == 11
    after = eng.kv[:, :, :, torch.tensor(ws.slots(0, 6))]
    assert torch.equal(after, before[:, :, :, [0, 1, 7, 8, 9, 10]])
    (o,) = run(eng, Pass(ws, [12], [0]))
    assert torch.isfinite(o.logits).all() and ws.frozen == 7


def test_pool_exhaustion_is_clear_and_changes_nothing(tiny):
    eng, ref = tiny  # 16 pages of 4 rows
    big, small = eng.new_working_set(), eng.new_working_set()
    run(eng, Pass(big, seq(39), [0]))  # 10 pages, one row free
    free = eng.pool.free_pages
    out = eng.forward([Pass(small, seq(30), [0]), Pass(big, [7], [0])])
    assert isinstance(out[0], PoolExhausted) and "exhausted" in str(out[0])
    assert small.frozen == 0 and not isinstance(out[1], Exception) and big.frozen == 40
    assert eng.pool.free_pages == free  # big's new row fit in its last page
    assert torch.allclose(out[1].logits[0], ref_logits(ref, seq(39) + [7])[-1], atol=TOL)


@pytest.mark.parametrize("make, err", [
    (lambda ws: Pass(ws, [97], [0]), InvalidArgument),  # out of vocabulary
    (lambda ws: Pass(ws, [-1], [0]), InvalidArgument),
    (lambda ws: Pass(ws, [3, 4], [2]), InvalidArgument),  # readout past the window
    (lambda ws: Pass(ws, [3, 4], [0], fold=3), InvalidArgument),  # fold past the window
    (lambda ws: Pass(ws, [], []), InvalidArgument),
    (lambda ws: Pass(ws, [3] * 129, [0]), ContextOverflow),
])
def test_bad_passes_fail_alone(tiny, make, err):
    eng, ref = tiny
    ws, good = eng.new_working_set(), eng.new_working_set()
    out = eng.forward([make(ws), Pass(good, [5, 6], [1])])
    assert isinstance(out[0], err) and str(out[0])
    assert ws.frozen == 0 and good.frozen == 2
    assert torch.allclose(out[1].logits[0], ref_logits(ref, [5, 6])[-1], atol=TOL)


def test_bad_handles_and_ranges(tiny):
    eng, _ = tiny
    ws = eng.new_working_set()
    run(eng, Pass(ws, [5, 6, 7], [0]))
    out = eng.forward([Pass(ws, [1], [0]), Pass(ws, [2], [0])])
    assert isinstance(out[1], InvalidArgument) and "two passes" in str(out[1])
    with pytest.raises(InvalidArgument):
        eng.truncate(ws, 99)
    with pytest.raises(InvalidArgument):
        eng.evict(ws, 2, 2)
    eng.release(ws)
    with pytest.raises(BadHandle):
        eng.fork(ws)
    (res,) = eng.forward([Pass(ws, [1], [0])])
    assert isinstance(res, BadHandle)


def test_commit_scratch_after_the_pass(tiny):
    eng, ref = tiny
    ws = eng.new_working_set()
    run(eng, Pass(ws, seq(5), [0]))
    run(eng, Pass(ws, [40, 41, 42], [0, 1, 2], fold=0))  # guest-side verification decides later
    eng.commit(ws, 2)
    assert ws.tokens == seq(5) + [40, 41]
    with pytest.raises(InvalidArgument):
        eng.commit(ws, 2)  # only one scratch row is left
    (o,) = run(eng, Pass(ws, [43], [0]))
    assert torch.allclose(o.logits[0], ref_logits(ref, seq(5) + [40, 41, 43])[-1], atol=TOL)


def test_long_prefill_beside_decodes_uses_separate_attention_groups(tiny):
    eng, ref = tiny
    a, b, c = eng.new_working_set(), eng.new_working_set(), eng.new_working_set()
    sb, sc = seq(5, 2), seq(4, 3)
    run(eng, Pass(b, sb, [0]), Pass(c, sc, [0]))
    long = seq(20, 4)  # past SMALL_WINDOW: attends in its own group
    oa, ob, oc = run(eng, Pass(a, long, [0, 19]), Pass(b, [9], [0]), Pass(c, [8, 7, 6], [0, 1, 2]))
    assert torch.allclose(oa.logits, ref_logits(ref, long)[[0, 19]], atol=TOL)
    assert torch.allclose(ob.logits[0], ref_logits(ref, sb + [9])[-1], atol=TOL)
    assert torch.allclose(oc.logits, ref_logits(ref, sc + [8, 7, 6])[-3:], atol=TOL)


def test_auto_dtype_is_float32_on_the_cpu():
    # bf16 verification rounds differently from one-row decoding (engine.default_dtype)
    from host.engine.engine import resolve_dtype
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    with pytest.raises(InvalidArgument, match="unknown dtype"):
        resolve_dtype("int8", torch.device("cpu"))


def test_a_context_on_consecutive_pages_is_one_run_of_slots():
    from host.engine.pages import PagePool
    from host.engine.working_set import WorkingSet

    pool = PagePool(16, 4)
    assert WorkingSet(1, pool, pages=[3, 4, 5]).slot_run(10) == (12, 22)  # rows 0..9 on pages 3, 4, 5
    assert WorkingSet(2, pool, pages=[3, 4, 9]).slot_run(8) == (12, 20)  # only the pages the rows use count
    assert WorkingSet(3, pool, pages=[3, 5, 6]).slot_run(5) is None  # a gap: attention gathers the slots
    assert WorkingSet(4, pool, pages=[4, 3]).slot_run(6) is None  # out of order
    assert WorkingSet(5, pool, pages=[4, 5]).slot_run(9) is None  # more rows than its pages hold


@pytest.mark.parametrize("kernel", [True, False])
def test_a_group_builds_the_mask_only_for_sdpa(kernel):
    """Windows the kernel attends, short or long, need no mask; SDPA's do."""
    from host.engine import attention
    from host.engine.pages import PagePool
    from host.engine.working_set import WorkingSet

    pool = PagePool(16, 4)
    a, b = WorkingSet(1, pool, pages=[0, 1, 2]), WorkingSet(2, pool, pages=[5, 3])
    g = attention.make_group(torch.device("cpu"), [0], [3], [6], [9], [a], True, kernel)
    assert g.ctx_range == (0, 9) and g.ctx_slots is None and g.passes == (([0], [3], [6]) if kernel else None)
    assert (g.mask is None) == kernel
    if not kernel:  # row i of the window sees keys 0..6 + i
        assert g.mask[0, 0].sum(-1).tolist() == [7, 8, 9]
    g = attention.make_group(torch.device("cpu"), [0, 3], [3, 1], [6, 4], [9, 5], [a, b], True, kernel)
    assert g.ctx_range is None and g.ctx_slots.tolist() == [list(range(9)), [20, 21, 22, 23, 12, 0, 0, 0, 0]]
    assert (g.mask is None) == kernel
    long, c = attention.SMALL_WINDOW + 1, WorkingSet(3, pool, pages=[6, 7, 8, 9, 10, 11])
    g = attention.make_group(torch.device("cpu"), [0], [long], [2], [long + 2], [c], True, kernel)
    assert (g.passes is None) != kernel and (g.mask is None) == kernel


def test_the_kv_pool_is_resident_only_as_it_is_written():
    """A pool sized for many clients costs memory as it fills: 1 GiB of zeros is not resident at
    start (torch.zeros wrote every page), and one written KV page makes a few KiB resident, not
    the 2 MiB huge page numpy's zeros would advise."""
    import psutil

    from host.engine.engine import _zeros

    proc = psutil.Process()
    before = proc.memory_info().rss
    kv = _zeros((8, 2, 4, 1 << 17, 64), torch.float32, torch.device("cpu"))  # 1 GiB
    assert kv.is_contiguous() and kv.dtype == torch.float32 and not kv[0, 0, 0, :16].any()
    for layer in range(8):
        kv[layer, :, :, 4096:4112] = 1.0  # one 16-row page of every layer, key and value, head
    assert proc.memory_info().rss - before < 64 << 20
    assert float(kv.sum()) == 8 * 2 * 4 * 16 * 64

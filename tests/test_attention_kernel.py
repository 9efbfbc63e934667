"""The paged attention kernel (host/engine/csrc/paged_attention.cpp) against a float64 reference,
against the engine's SDPA path, and for the property speculative decoding leans on: a query row's
result does not depend on the batch around it."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from host.conformance.models import TinyTokenizer
from host.engine import Engine, kernels
from test_engine_stack import batches, tiny_model

KV_HEADS, HEADS, D, SLOTS = 2, 6, 32, 1024


@pytest.fixture(scope="module")
def kernel():
    k = kernels.paged_attention()
    assert k is not None, "the CPU kernels should build here (make's set-up builds them)"
    return k


def reference(q, kv, ctx, base, starts, windows, frozen, scale):
    """q: [heads, T, D]; the same contract as the kernel, in float64, one row at a time."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = q.shape[0] // kv.shape[1]
    for b, (s, w, f) in enumerate(zip(starts.tolist(), windows.tolist(), frozen.tolist())):
        for i in range(w):
            n = f + i + 1  # the frozen rows and the window's rows up to this one
            slots = ctx[b, :n] if ctx.numel() else torch.arange(base, base + n)
            for h in range(q.shape[0]):
                k = kv[0, h // group, slots].double()
                v = kv[1, h // group, slots].double()
                out[h, s + i] = torch.softmax(k @ q[h, s + i].double() * scale, 0) @ v
    return out


def problem(seed, windows, frozen):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, KV_HEADS, SLOTS, D, generator=g)
    t = sum(windows)
    # q strided as the layer stack's (q's and k's heads side by side)
    q = torch.randn(t, HEADS + KV_HEADS, D, generator=g)[:, :HEADS].transpose(0, 1)
    lengths = [f + w for f, w in zip(frozen, windows)]
    ctx = torch.zeros(len(windows), max(lengths), dtype=torch.long)
    for b, n in enumerate(lengths):  # scattered, as pages of concurrent clients are
        ctx[b, :n] = torch.randperm(SLOTS, generator=g)[:n]
    starts = [sum(windows[:b]) for b in range(len(windows))]
    return q, kv, ctx, *(torch.tensor(x, dtype=torch.long) for x in (starts, windows, frozen))


def empty_out(q):
    return torch.full((q.shape[1], HEADS, D), float("nan")).transpose(0, 1)  # token-major, as the engine's


@pytest.mark.parametrize("windows,frozen", [
    ([1], [0]),  # one row, one key
    ([1] * 8, [5, 16, 17, 40, 0, 31, 33, 100]),  # decode rows: lengths on, off and past the 16 lanes
    ([4, 1, 7, 16], [12, 60, 0, 3]),  # verification windows of mixed lengths
    # contexts of several segments (128 rows each), windows that cross a segment's end
    ([1, 4, 2, 8, 1], [300, 125, 127, 250, 511]),
])
def test_the_kernel_equals_attention_in_float64(kernel, windows, frozen):
    q, kv, ctx, starts, wins, fz = problem(len(windows), windows, frozen)
    out = empty_out(q)
    scale = 1 / math.sqrt(D)
    kernel(out, q, kv, ctx, 0, starts, wins, fz, scale)
    want = reference(q, kv, ctx, 0, starts, wins, fz, scale)
    torch.testing.assert_close(out.double(), want, rtol=2e-6, atol=2e-6)


def test_a_context_that_is_one_run_of_slots_reads_from_its_base(kernel):
    q, kv, _, starts, wins, fz = problem(7, [3], [20])
    none = torch.empty(0, dtype=torch.long)
    out = empty_out(q)
    kernel(out, q, kv, none, 100, starts, wins, fz, 0.25)
    want = reference(q, kv, none, 100, starts, wins, fz, 0.25)
    torch.testing.assert_close(out.double(), want, rtol=2e-6, atol=2e-6)


def test_a_row_gets_the_same_bits_alone_and_in_a_window(kernel):
    """Each row of a batch of verification windows, computed again as a one-row pass over the
    same context (what plain decoding computes for it): equal exactly, not to a tolerance."""
    q, kv, ctx, starts, wins, fz = problem(3, [4, 1, 7, 9], [12, 60, 9, 250])
    batch = empty_out(q)
    kernel(batch, q, kv, ctx, 0, starts, wins, fz, 0.2)
    for b in range(4):
        for i in range(wins[b]):
            r = int(starts[b]) + i
            one = empty_out(q)
            lone = [torch.tensor([x]) for x in (r, 1, int(fz[b]) + i)]
            kernel(one, q, kv, ctx[b:b + 1].contiguous(), 0, *lone, 0.2)
            assert torch.equal(one[:, r], batch[:, r])


def test_bad_arguments_are_refused_not_read_past(kernel):
    q, kv, ctx, starts, wins, fz = problem(1, [2], [3])
    out = empty_out(q)
    with pytest.raises(RuntimeError, match="visible context"):
        kernel(out, q, kv, ctx, 0, starts, wins, fz + 10, 0.2)  # past the context's slots
    with pytest.raises(RuntimeError, match="visible context"):
        kernel(out, q, kv, torch.empty(0, dtype=torch.long), SLOTS - 3, starts, wins, fz, 0.2)
    with pytest.raises(RuntimeError, match="past the pool"):
        kernel(out, q, kv, ctx + SLOTS, 0, starts, wins, fz, 0.2)
    with pytest.raises(RuntimeError, match="bad window"):
        kernel(out, q, kv, ctx, 0, starts, wins * 0, fz, 0.2)  # an empty window
    with pytest.raises(RuntimeError, match="float32"):
        kernel(out, q.double(), kv, ctx, 0, starts, wins, fz, 0.2)


def _run(model, kernel: bool):
    eng = Engine(copy.deepcopy(model), TinyTokenizer(), name="t", kv_pages=32, page_size=4)
    assert eng.attention_kernel is not None
    if not kernel:
        eng.attention_kernel = None
    out = []
    for passes in batches(eng):
        out += [o.logits for o in eng.forward(passes)]
    return out


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])  # the layer stack, and transformers' layers
def test_the_engine_with_the_kernel_matches_its_sdpa_path(model_type):
    """Mixed batches (prefills, decode rows, windows, a fork, a truncation) over pages of 4 slots."""
    model = tiny_model(model_type)
    ours, theirs = _run(model, True), _run(model, False)
    assert len(ours) == len(theirs) == 10
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)

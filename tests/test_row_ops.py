"""The layer stack's row ops (host/engine/csrc/row_ops.cpp) against torch's operators: RoPE with
the same bits, the norm and SiLU within float tolerance, each row alone whatever the batch, and
their refusals."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from host.engine import kernels

HEADS, KV_HEADS, D, SLOTS = 6, 2, 32, 64


@pytest.fixture(scope="module")
def ops():
    k = kernels.row_ops()
    assert k is not None, "the CPU kernels should build here (make's set-up builds them)"
    return k


def rms_norm(h, w, eps):  # transformers' RMSNorm in float32
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("n", [576, 64, 37, 5])
def test_residual_norm_adds_and_normalises(ops, n):
    g = torch.Generator().manual_seed(n)
    x, delta, w = torch.randn(9, n, generator=g), torch.randn(9, n, generator=g), torch.randn(n, generator=g)
    h, y = ops.residual_norm(x, delta, w, 1e-5)
    assert torch.equal(h, x + delta)
    assert torch.allclose(y, rms_norm(x + delta, w, 1e-5), rtol=1e-5, atol=1e-6)
    h0, y0 = ops.residual_norm(x, None, w, 1e-5)  # no delta: x itself
    assert h0.data_ptr() == x.data_ptr()
    assert torch.allclose(y0, rms_norm(x, w, 1e-5), rtol=1e-5, atol=1e-6)
    # a wrong epsilon or weight would show
    assert not torch.allclose(ops.residual_norm(x, None, w, 1.0)[1], y0, atol=1e-3)


def qkv_problem(t, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(t, (HEADS + 2 * KV_HEADS) * D, generator=g)
    ang = torch.randn(t, 1, D // 2, generator=g)
    cos = torch.cat([ang.cos(), ang.cos()], -1)
    sin = torch.cat([ang.sin(), ang.sin()], -1)
    sin = torch.cat([-sin[..., :D // 2], sin[..., D // 2:]], -1)  # stack.py's sign-folded table
    slots = torch.randperm(SLOTS, generator=g)[:t]
    return qkv, cos, sin, slots


def test_rope_store_rotates_with_torchs_bits_and_writes_the_pool(ops):
    t = 7
    qkv, cos, sin, slots = qkv_problem(t)
    kv = torch.full((2, KV_HEADS, SLOTS, D), float("nan"))
    q = ops.rope_store(qkv, cos, sin, kv, slots, HEADS, KV_HEADS)
    qk = qkv[:, :(HEADS + KV_HEADS) * D].view(t, HEADS + KV_HEADS, D)
    want = qk * cos + torch.roll(qk, D // 2, -1) * sin  # stack.py's expression
    assert q.shape == (t, HEADS, D)
    assert torch.equal(q, want[:, :HEADS])
    assert torch.equal(kv[0][:, slots].transpose(0, 1), want[:, HEADS:])
    assert torch.equal(kv[1][:, slots].transpose(0, 1), qkv[:, (HEADS + KV_HEADS) * D:].view(t, KV_HEADS, D))
    untouched = torch.ones(SLOTS, dtype=torch.bool)
    untouched[slots] = False
    assert kv[:, :, untouched].isnan().all()


@pytest.mark.parametrize("inter", [1536, 48, 21])
def test_silu_mul(ops, inter):
    g = torch.Generator().manual_seed(inter)
    gu = torch.randn(5, 2 * inter, generator=g) * 6  # far into both tails of SiLU
    gu[0, :4] = torch.tensor([0.0, -100.0, 100.0, -0.0])
    want = F.silu(gu[:, :inter]) * gu[:, inter:]
    assert torch.allclose(ops.silu_mul(gu, inter), want, rtol=1e-6, atol=1e-6)


def test_a_rows_result_does_not_depend_on_the_batch(ops):
    g = torch.Generator().manual_seed(3)
    x, delta, w = torch.randn(20, 96, generator=g), torch.randn(20, 96, generator=g), torch.randn(96, generator=g)
    gu = torch.randn(20, 2 * 80, generator=g)
    _, y = ops.residual_norm(x, delta, w, 1e-6)
    s = ops.silu_mul(gu, 80)
    for r in (0, 7, 19):
        assert torch.equal(ops.residual_norm(x[r:r + 1], delta[r:r + 1], w, 1e-6)[1][0], y[r])
        assert torch.equal(ops.silu_mul(gu[r:r + 1], 80)[0], s[r])


@pytest.mark.parametrize("case", ["slot-past", "slot-negative", "columns", "slots-count", "table"])
def test_rope_store_refuses_bad_arguments(ops, case):
    qkv, cos, sin, slots = qkv_problem(3)
    kv = torch.zeros(2, KV_HEADS, SLOTS, D)
    heads = HEADS
    if case == "slot-past":
        slots[1] = SLOTS
    elif case == "slot-negative":
        slots[0] = -1
    elif case == "columns":
        heads = HEADS + 1
    elif case == "slots-count":
        slots = slots[:2]
    elif case == "table":
        cos = cos[:2]
    with pytest.raises(RuntimeError, match="rope_store"):
        ops.rope_store(qkv, cos, sin, kv, slots, heads, KV_HEADS)
    assert (kv == 0).all(), "a refused call writes nothing"


def test_norm_and_silu_refuse_bad_arguments(ops):
    x = torch.randn(3, 16)
    with pytest.raises(RuntimeError, match="weight"):
        ops.residual_norm(x, None, torch.ones(15), 1e-6)
    with pytest.raises(RuntimeError, match="delta"):
        ops.residual_norm(x, torch.randn(2, 16), torch.ones(16), 1e-6)
    with pytest.raises(RuntimeError, match="float32"):
        ops.residual_norm(x.double(), None, torch.ones(16), 1e-6)
    with pytest.raises(RuntimeError, match="columns"):
        ops.silu_mul(x, 7)

"""Products with 8-bit activations (host/engine/csrc/q8_linear.cpp, blocks.repack_q8): for Q8_0,
Q4_0, Q4_1 and the K-quants Q4_K, Q5_K, Q6_K, random blocks (extreme and subnormal scales included) give the bits of a plain
numpy statement of the arithmetic (each row quantized per 32 k, integer sums, one fused
multiply-add a group), for every row count 1..40 and prompt passes' counts beyond: so a row's
result depends on that row alone. On real weights the result is near the float32 product."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from test_block_linear import dequantized, random_blocks, scaled_x, whole_blocks

from host.engine import blocks, kernels

Q8_FORMATS = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_K, T.Q6_K]


@pytest.fixture(scope="module")
def ops():
    k = kernels.skinny()
    assert k is not None, "the CPU kernels should build here (make's set-up builds them)"
    return k


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 a * b + c in one rounding. a * b is exact in float64; the sum's float64 rounding
    error (two-sum) nudges it off a float32 halfway point it may have landed on."""
    p = a.astype(np.float64) * b.astype(np.float64)
    c = c.astype(np.float64)
    s = p + c
    bb = s - p
    e = (p - (s - bb)) + (c - bb)
    s = np.where(e != 0, np.nextafter(s, np.where(e > 0, np.inf, -np.inf)), s)
    return s.astype(np.float32)


def reference(raw: np.ndarray, kind: T, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The arithmetic q8_linear.cpp states, in numpy, one row at a time: activations quantized
    per 32 k; a weight group (its scales' k: 32, Q6_K's 16) summed in integers and added with one
    fused multiply-add (and its min with another), in order."""
    scales, q = blocks.groups(torch.from_numpy(raw), kind)
    fmt = blocks.FORMATS[kind]
    qw = (q.view(torch.int8).numpy() if fmt.bits == 8 else q.numpy()).astype(np.int64) - fmt.offset  # [N, G, group]
    dw = scales[0].float().numpy()  # [N, G]
    mw = scales[1].float().numpy() if len(scales) == 2 else None
    per = 32 // fmt.group  # weight groups to an activation group
    out = []
    for row in x.numpy().astype(np.float32):
        xg = row.reshape(-1, 32)
        amax = np.abs(xg).max(-1)
        d = (amax / np.float32(127)).astype(np.float32)
        inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), 0).astype(np.float32)
        qx = np.rint(xg * inv[:, None]).astype(np.int64)  # rint: to nearest even
        s = (d * qx.sum(-1).astype(np.float32)).astype(np.float32)
        isum = np.einsum("ngk,gk->ng", qw, qx.reshape(-1, fmt.group))  # exact in int64
        acc = np.zeros(qw.shape[0], np.float32)
        for g in range(qw.shape[1]):
            acc = fma32(isum[:, g].astype(np.float32), (dw[:, g] * d[g // per]).astype(np.float32), acc)
            if mw is not None:
                acc = fma32(mw[:, g], np.full_like(acc, s[g // per]), acc)
        out.append(acc if bias is None else (acc + bias.numpy()).astype(np.float32))
    return torch.from_numpy(np.stack(out))


@pytest.mark.parametrize("kind", Q8_FORMATS, ids=lambda t: t.name)
@pytest.mark.parametrize("n,k", [(70, 96), (16, 32), (5, 576)])
def test_products_have_the_bits_of_the_stated_arithmetic(ops, kind, n, k):
    k = whole_blocks(kind, k)
    raw = random_blocks(kind, n, k)
    packed = blocks.repack_q8(torch.from_numpy(raw), kind, ops.q8_block)
    fmt = blocks.Q8_ACTIVATIONS + kind
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2))
    x = scaled_x(100, k)
    x[3, :32] = 0.0  # a group of zeros: scale 0
    want = reference(raw, kind, x, bias)
    for rows in [*range(1, 41), 67, 100]:
        got = ops.block_linear(x[:rows], packed, fmt, bias, n)
        assert torch.equal(got, want[:rows]), f"{kind.name} {rows} rows"
    assert torch.equal(ops.block_linear(x[:7], packed, fmt, None, n), reference(raw, kind, x[:7], None))


@pytest.mark.parametrize("kind", Q8_FORMATS, ids=lambda t: t.name)
def test_widened_weights_and_rows_are_gguf_dequantize(ops, kind):
    n, k = 37, whole_blocks(kind, 64)
    raw = random_blocks(kind, n, k, seed=3)
    packed = blocks.repack_q8(torch.from_numpy(raw), kind, ops.q8_block)
    fmt = blocks.Q8_ACTIVATIONS + kind
    want = dequantized(raw, kind, k)
    assert torch.equal(ops.block_dense(packed, fmt, n), want)
    ids = torch.tensor([0, 36, 5, 5, 17])
    assert torch.equal(ops.block_gather(packed, fmt, n, ids), want[ids])
    embedding = blocks.BlockEmbedding(packed, fmt, n, k)
    assert torch.equal(embedding(ids.view(1, -1))[0], want[ids])
    assert "+q8" in repr(embedding)


@pytest.mark.parametrize("kind", [T.Q8_0, T.Q4_0, T.Q4_1], ids=lambda t: t.name)  # what gguf-py quantizes
def test_real_weights_give_about_the_float32_product(ops, kind):
    """gguf-py's own quantization of Gaussian weights; activations shaped like a layer's input
    (a few large features): the relative error is llama.cpp's order, ~1%."""
    n, k = 96, 576
    g = torch.Generator().manual_seed(4)
    w = (torch.randn(n, k, generator=g) * 0.05).numpy()
    raw = gguf.quants.quantize(w, kind)
    x = torch.randn(9, k, generator=g)
    x[:, ::97] *= 20.0
    exact = x @ dequantized(raw, kind, k).T
    got = ops.block_linear(x, blocks.repack_q8(torch.from_numpy(raw), kind, ops.q8_block),
                           blocks.Q8_ACTIVATIONS + kind, None, n)
    rel = (got - exact).norm() / exact.norm()
    assert 1e-5 < rel < 2e-2, rel  # not the exact product, and near it


def test_formats_and_refusals(ops):
    assert blocks.q8_format(T.Q4_1) == blocks.Q8_ACTIVATIONS + T.Q4_1
    assert blocks.q8_format(T.Q6_K) == blocks.Q8_ACTIVATIONS + T.Q6_K
    assert blocks.q8_format(T.BF16) == T.BF16  # no such kernel: exact
    assert blocks.name(blocks.Q8_ACTIVATIONS + T.Q8_0) == "Q8_0+q8"
    raw = torch.from_numpy(random_blocks(T.BF16, 8, 64))
    with pytest.raises(ValueError, match="no kernel with 8-bit activations"):
        blocks.repack_q8(raw, T.BF16, ops.q8_block)
    packed = blocks.repack_q8(torch.from_numpy(random_blocks(T.Q4_1, 8, 64)), T.Q4_1, ops.q8_block)
    with pytest.raises(RuntimeError, match="no kernel with 8-bit activations"):
        ops.block_linear(torch.randn(1, 64), packed, blocks.Q8_ACTIVATIONS + T.BF16, None, 8)
    with pytest.raises(RuntimeError, match="bytes"):
        ops.block_linear(torch.randn(1, 64), packed, blocks.Q8_ACTIVATIONS + T.Q8_0, None, 8)
    with pytest.raises(RuntimeError, match="columns"):
        ops.block_linear(torch.randn(1, 32), packed, blocks.Q8_ACTIVATIONS + T.Q4_1, None, 8)
    with pytest.raises(RuntimeError, match="outputs do not fit"):
        ops.block_linear(torch.randn(1, 64), packed, blocks.Q8_ACTIVATIONS + T.Q4_1, None, 99)

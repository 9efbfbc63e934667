"""Products over GGUF blocks (host/engine/csrc/block_linear.cpp, host/engine/blocks.py): for
each format, random blocks, extreme and subnormal scales included, give the bits of
`gguf.quants.dequantize` followed by the float32 kernel, for every row count 1..40 and prompt
passes' counts beyond."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from host.engine import blocks, kernels

FORMATS = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_K, T.Q6_K, T.F16, T.BF16]


@pytest.fixture(scope="module")
def ops():
    k = kernels.skinny()
    assert k is not None, "the CPU kernels should build here (make's set-up builds them)"
    return k


def random_blocks(kind: T, n: int, k: int, seed: int = 0) -> np.ndarray:
    """[n, row bytes] of random blocks: random quants, and float16 scales drawn from subnormal,
    tiny, ordinary and near-largest magnitudes of both signs (never inf or NaN)."""
    rng = np.random.default_rng(seed)
    fmt = blocks.FORMATS[kind]
    if fmt.bits == 16:  # finite values of every magnitude: subnormal, tiny, ordinary, large
        dtype = torch.bfloat16 if kind == T.BF16 else torch.float16
        w = rng.standard_normal((n, k)) * 10.0 ** rng.uniform(-8, 4 if kind == T.F16 else 20, (n, k))
        w[rng.random((n, k)) < 0.05] = 0.0
        t = torch.from_numpy(w).to(dtype)
        t[torch.from_numpy(rng.random((n, k)) < 0.05)] = torch.finfo(dtype).smallest_normal / 4  # subnormal
        t[~torch.isfinite(t)] = torch.finfo(dtype).max
        return t.view(torch.uint8).numpy().reshape(n, -1)
    nb = k // fmt.block_weights
    raw = rng.integers(0, 256, size=(n, nb, fmt.block_bytes), dtype=np.uint8)
    picks = np.array([0x0001, 0x03FF, 0x0400, 0x1C00, 0x3C00, 0x2E66, 0x7BFF, 0x0000], dtype=np.uint16)
    for at in fmt.float16_at:
        bits = rng.integers(0, 0x7C00, size=(n, nb), dtype=np.uint16)  # any finite magnitude
        chosen = rng.random((n, nb)) < 0.5
        bits[chosen] = rng.choice(picks, size=int(chosen.sum()))
        bits |= (rng.random((n, nb)) < 0.5).astype(np.uint16) << 15
        raw[..., at:at + 2] = bits[..., None].view(np.uint8).reshape(n, nb, 2)
    return raw.reshape(n, -1)


def dequantized(raw: np.ndarray, kind: T, k: int) -> torch.Tensor:
    if kind in (T.F16, T.BF16):  # gguf-py reads these as float32 with numpy's own widening
        t = torch.from_numpy(raw.copy()).view(torch.bfloat16 if kind == T.BF16 else torch.float16)
        return t.float().reshape(raw.shape[0], k)
    return torch.from_numpy(gguf.quants.dequantize(raw, kind).reshape(raw.shape[0], k).astype(np.float32))


def whole_blocks(kind: T, k: int) -> int:
    """k rounded up to whole blocks of the format (a K-quant's super-blocks are 256 weights)."""
    bw = blocks.FORMATS[kind].block_weights
    return -(-k // bw) * bw


def scaled_x(rows: int, k: int, seed: int = 1) -> torch.Tensor:
    # small enough that near-largest scales times 127 times K stay finite
    return torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)) * 1e-3


@pytest.mark.parametrize("kind", FORMATS, ids=lambda t: t.name)
@pytest.mark.parametrize("n,k", [(200, 96), (64, 32), (7, 576)])
def test_products_have_the_bits_of_the_dequantized_float32_kernel(ops, kind, n, k):
    k = whole_blocks(kind, k)
    raw = random_blocks(kind, n, k)
    dense = dequantized(raw, kind, k)
    packed = blocks.repack(torch.from_numpy(raw), kind, ops.block)
    reference = ops.pack(dense)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2))
    x = scaled_x(100, k)
    # 1..40: tiles widening in registers; 41 and more (and from 17 on AVX-512): widened once a
    # chunk of k at a time (block_linear.cpp), a prompt pass's row counts
    for rows in [*range(1, 41), 41, 67, 100]:
        for b in (bias, None):
            got = ops.block_linear(x[:rows], packed, kind, b, n)
            want = ops.linear(x[:rows], reference, b, n)
            assert torch.isfinite(want).all()
            assert torch.equal(got, want), f"{kind.name}, {rows} rows"
    whole = ops.block_linear(x, packed, kind, bias, n)
    for r in range(100):  # a row's result does not depend on the rows around it
        assert torch.equal(ops.block_linear(x[r:r + 1], packed, kind, bias, n)[0], whole[r])


@pytest.mark.parametrize("kind", FORMATS, ids=lambda t: t.name)
def test_widened_weights_are_gguf_dequantize(ops, kind):
    n, k = 150, whole_blocks(kind, 128)
    raw = random_blocks(kind, n, k, seed=3)
    dense = dequantized(raw, kind, k)
    packed = blocks.repack(torch.from_numpy(raw), kind, ops.block)
    assert torch.equal(ops.block_dense(packed, kind, n), dense)
    ids = torch.tensor([0, 149, 63, 64, 65, 7, 7])
    assert torch.equal(ops.block_gather(packed, kind, n, ids), dense[ids])
    assert torch.equal(blocks.dequantize(torch.from_numpy(raw), kind), dense)  # the kernel-less path


@pytest.mark.parametrize("kind", [T.Q8_0, T.Q4_0, T.Q4_1], ids=lambda t: t.name)  # gguf-py quantizes no K-quant
def test_blocks_that_gguf_py_quantized(ops, kind):
    w = np.random.default_rng(4).standard_normal((96, 256)).astype(np.float32)
    raw = gguf.quants.quantize(w, kind)
    dense = dequantized(raw, kind, 256)
    packed = blocks.repack(torch.from_numpy(raw), kind, ops.block)
    x = torch.randn(9, 256)
    assert torch.equal(ops.block_linear(x, packed, kind, None, 96), ops.linear(x, ops.pack(dense), None, 96))


def test_refusals(ops):
    raw = random_blocks(T.Q8_0, 70, 64)
    packed = blocks.repack(torch.from_numpy(raw), T.Q8_0, ops.block)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="no kernel"):
        ops.block_linear(x, packed, 6, None, 70)  # Q5_0
    with pytest.raises(RuntimeError, match="groups are"):
        ops.block_linear(x, packed, T.Q4_0, None, 70)
    with pytest.raises(RuntimeError, match="columns"):
        ops.block_linear(torch.randn(2, 32), packed, T.Q8_0, None, 70)
    with pytest.raises(RuntimeError, match="do not fit"):
        ops.block_linear(x, packed, T.Q8_0, None, 300)
    with pytest.raises(RuntimeError, match="outside"):
        ops.block_gather(packed, T.Q8_0, 70, torch.tensor([70]))
    with pytest.raises(ValueError, match="whole"):
        blocks.repack(torch.zeros(4, 33, dtype=torch.uint8), T.Q8_0, ops.block)
    assert ops.block_linear(torch.empty(0, 64), packed, T.Q8_0, None, 70).shape == (0, 70)


def test_a_float_linear_in_blocks(ops):
    """from_linear: BF16 and F16 keep such weights exactly; Q8_0 is gguf-py's quantization, widened
    exactly, and the bias rides along."""
    from gguf.quants import dequantize, quantize

    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 40)
    with torch.no_grad():
        lin.weight.copy_(lin.weight.to(torch.bfloat16).float())
    assert torch.equal(blocks.from_linear(lin, blocks.GGML["BF16"]).weight, lin.weight)
    q = blocks.from_linear(lin, blocks.GGML["Q8_0"])
    w = lin.weight.detach().numpy()
    assert torch.equal(q.weight, torch.from_numpy(dequantize(quantize(w, T.Q8_0), T.Q8_0).reshape(w.shape)))
    assert torch.equal(q.bias, lin.bias) and q.format == T.Q8_0
    assert blocks.from_linear(lin, blocks.GGML["Q8_0"], q8=True).format == blocks.Q8_ACTIVATIONS + T.Q8_0


@pytest.mark.parametrize("kind", FORMATS, ids=lambda t: t.name)
def test_rows_taken_from_packed_blocks(ops, kind):
    """take_rows (a draft head's readout over its vocabulary's rows of the target's): the rows of a
    packed weight, in either layout, are the packing of those rows of the file, widened alike; a q8
    layout's rows laid out exactly are the exact packing."""
    n, k = 150, 256
    raw = torch.from_numpy(random_blocks(kind, n, k))
    ids = torch.tensor([149, 0, 64, 63, 7, 7, 128, 100])
    layouts = [kind] + ([blocks.Q8_ACTIVATIONS + kind] if kind in blocks.Q8_KERNELS else [])
    for fmt in layouts:
        packed = blocks.pack(raw, fmt)
        taken = blocks.take_rows(packed, fmt, ids)
        assert torch.equal(taken, blocks.pack(raw[ids], fmt))
        assert torch.equal(ops.block_dense(taken, fmt, len(ids)), ops.block_dense(packed, fmt, n)[ids])
        assert torch.equal(blocks.take_rows(packed, fmt, ids, into=kind), blocks.pack(raw[ids], kind))
    with pytest.raises(ValueError, match="another file format"):
        blocks.take_rows(blocks.pack(raw, kind), kind, ids, into=T.Q4_1 if kind != T.Q4_1 else T.Q8_0)

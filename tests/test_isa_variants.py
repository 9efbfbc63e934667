"""The products built for each instruction set narrower than this CPU's own build that it runs
(kernels.VARIANTS: AVX2 and scalar code on an AVX-512 CPU) give the bits of its own build, for
every block format and for float32 and bfloat16 weights, and with 8-bit activations, at row counts
that take each path (one register tile, several, and the chunked widening of prompt passes). So CI on either kind of
VM tests every SIMD path the other kind runs."""

from __future__ import annotations

import platform

import pytest
import torch
from gguf import GGMLQuantizationType as T
from test_block_linear import FORMATS, dequantized, random_blocks, scaled_x, whole_blocks
from test_q8_linear import Q8_FORMATS

from host.engine import blocks, kernels

ROWS = (1, 4, 5, 9, 12, 17, 41, 67)


@pytest.fixture(scope="module")
def native():
    ops = kernels.skinny()
    assert ops is not None, "the CPU kernels should build here (make's set-up builds them)"
    return ops


def test_an_x86_cpu_tests_the_scalar_code_at_least():
    assert kernels.other_variants()[-1:] == ["scalar"] or platform.machine() not in ("x86_64", "AMD64")


# AVX-512 is another variant only where the native build has VNNI, and the exact products' code is
# the same with it and without: that variant differs only in q8_linear.cpp's byte dot products
EXACT_VARIANTS = [v for v in kernels.other_variants() if v != "avx512"]


@pytest.mark.parametrize("isa", EXACT_VARIANTS)
def test_a_variants_products_have_the_native_bits(native, isa):
    ops = kernels.variant(isa)
    assert ops is not None, f"the {isa} products should build here"
    n = 70  # not a whole number of either build's column blocks
    for kind in FORMATS:
        k = whole_blocks(kind, 96)
        raw = torch.from_numpy(random_blocks(kind, n, k, seed=int(kind)))
        ours, theirs = (blocks.repack(raw, kind, o.block) for o in (native, ops))
        bias = torch.randn(n, generator=torch.Generator().manual_seed(5))
        x = scaled_x(max(ROWS), k)
        for rows in ROWS:
            want = native.block_linear(x[:rows], ours, kind, bias, n)
            assert torch.equal(ops.block_linear(x[:rows], theirs, kind, bias, n), want), f"{isa} {kind.name} {rows}"
        assert torch.equal(ops.block_dense(theirs, kind, n), dequantized(raw.numpy(), kind, k))
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.randn(n, 96).to(dtype)
        x = torch.randn(max(ROWS), 96)
        for rows in ROWS:
            want = native.linear(x[:rows], native.pack(w), None, n)
            assert torch.equal(ops.linear(x[:rows], ops.pack(w), None, n), want), f"{isa} {dtype} {rows}"


@pytest.mark.parametrize("isa", kernels.other_variants())
def test_a_variants_products_with_8_bit_activations_have_the_native_bits(native, isa):
    ops = kernels.variant(isa)
    n = 70
    for kind in Q8_FORMATS:
        k = whole_blocks(kind, 96)
        raw = torch.from_numpy(random_blocks(kind, n, k, seed=int(kind)))
        ours, theirs = (blocks.repack_q8(raw, kind, o.q8_block) for o in (native, ops))
        fmt = blocks.Q8_ACTIVATIONS + kind
        x = scaled_x(max(ROWS), k)
        for rows in ROWS:
            want = native.block_linear(x[:rows], ours, fmt, None, n)
            assert torch.equal(ops.block_linear(x[:rows], theirs, fmt, None, n), want), f"{isa} {kind.name} {rows}"


def test_a_variant_refuses_what_the_native_build_refuses(native):
    if not kernels.other_variants():
        pytest.skip("no x86-64 variant runs on this CPU")
    ops = kernels.variant(kernels.other_variants()[-1])
    packed = blocks.repack(torch.from_numpy(random_blocks(T.Q8_0, 8, 64)), T.Q8_0, ops.block)
    with pytest.raises(RuntimeError, match="no kernel"):
        ops.block_linear(torch.randn(1, 64), packed, 6, None, 8)  # Q5_0

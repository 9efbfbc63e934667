"""The few-row product (host/engine/csrc/skinny_linear.cpp) against a float64 reference, for the
property speculative decoding leans on (a row's result does not depend on the rows around it),
its refusals, and where linear.py sends products of each row count."""

from __future__ import annotations

import os

import pytest
import torch

from host.engine import kernels, linear


@pytest.fixture(scope="module")
def ops():
    k = kernels.skinny()
    assert k is not None, "the CPU kernels should build here (make's set-up builds them)"
    return k


def weights(n, k, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) / k ** 0.5, torch.randn(n, generator=g) if bias else None


@pytest.mark.parametrize("n,k", [(64, 16), (100, 37), (960, 576), (7, 5), (130, 1)])
@pytest.mark.parametrize("bias", [True, False])
def test_it_computes_x_times_w_transposed_plus_b(ops, n, k, bias):
    w, b = weights(n, k, bias)
    x = torch.randn(13, k)
    y = ops.linear(x, ops.pack(w), b, n)
    want = x.double() @ w.double().T + (0 if b is None else b.double())
    assert y.shape == (13, n) and y.is_contiguous()
    assert torch.allclose(y.double(), want, atol=1e-5, rtol=1e-5)


def test_a_rows_result_does_not_depend_on_the_batch(ops):
    w, b = weights(200, 96)
    packed = ops.pack(w)
    x = torch.randn(40, 96)
    whole = ops.linear(x, packed, b, 200)
    for r in range(40):  # alone, and at every place in batches of other sizes
        assert torch.equal(ops.linear(x[r:r + 1], packed, b, 200)[0], whole[r])
    for lo, hi in [(0, 5), (3, 9), (7, 20), (11, 40)]:
        assert torch.equal(ops.linear(x[lo:hi], packed, b, 200), whole[lo:hi])
    # a strided view of the rows gives the same bits as a contiguous copy
    assert torch.equal(ops.linear(x.t().contiguous().t(), packed, b, 200), whole)


def test_no_rows_give_an_empty_result(ops):
    w, b = weights(70, 8)
    assert ops.linear(torch.empty(0, 8), ops.pack(w), b, 70).shape == (0, 70)


@pytest.mark.parametrize("case,message", [
    ("columns", "columns"),
    ("outputs-over", "do not fit"),
    ("outputs-under", "do not fit"),
    ("bias", "bias"),
    ("dtype", "float32"),
    ("weight", "skinny_pack"),
])
def test_bad_arguments_are_refused(ops, case, message):
    w, b = weights(100, 16)
    packed, x, n = ops.pack(w), torch.randn(3, 16), 100
    if case == "columns":
        x = torch.randn(3, 17)
    elif case == "outputs-over":
        n = 129
    elif case == "outputs-under":
        n = 64  # a whole block would be left unused: not this weight's output count
    elif case == "bias":
        b = torch.randn(99)
    elif case == "dtype":
        x = x.double()
    elif case == "weight":
        packed = w
    with pytest.raises(RuntimeError, match=message):
        ops.linear(x, packed, b, n)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.pack(w.double())
    with pytest.raises(RuntimeError, match="skinny_pack"):  # blocks of another dtype
        ops.linear(torch.randn(3, 16), ops.pack(w).half(), b, 100)


@pytest.mark.parametrize("n,k", [(200, 96), (7, 5), (960, 576)])
def test_bfloat16_blocks_give_the_float32_blocks_bits(ops, n, k):
    """A weight whose values are all bfloat16 values (a bfloat16 checkpoint run in float32) may
    be packed as bfloat16: each is widened to the same float32, so every row's bits are the same."""
    w, b = weights(n, k)
    w = w.bfloat16().float()
    wide, narrow = ops.pack(w), ops.pack(w.bfloat16())
    assert narrow.dtype == torch.bfloat16 and narrow.shape == wide.shape
    x = torch.randn(40, k)
    for rows in (1, 2, 5, 12, 13, 40):
        assert torch.equal(ops.linear(x[:rows], narrow, b, n), ops.linear(x[:rows], wide, b, n))


def test_linear_py_packs_exact_bfloat16_weights_narrow_and_others_wide(ops):
    mod = torch.nn.Linear(96, 150)
    assert linear.pack(mod).skinny.dtype == torch.float32  # random float32 values: not exact in bfloat16
    with torch.no_grad():
        mod.weight.copy_(mod.weight.bfloat16().float())
    packed = linear.pack(mod)
    assert packed.skinny.dtype == torch.bfloat16
    x = torch.randn(9, 96)
    assert torch.allclose(linear.packed_linear(x, packed), mod(x), atol=1e-5)
    with torch.no_grad():
        mod.weight[3, 4] = float("nan")  # a NaN never equals itself: kept as it is
    assert linear.pack(mod).skinny.dtype == torch.float32


def test_linear_py_sends_every_row_count_to_the_kernel_with_one_copy(ops):
    mod = torch.nn.Linear(96, 150)
    packed = linear.pack(mod)
    assert packed.skinny is not None and packed.blocked is None and packed.outputs == 150
    x = torch.randn(300, 96)
    for rows in (1, 7, 32, 33, 300):  # a prompt pass too, and its rows get a decode's bits
        got = linear.packed_linear(x[:rows], packed)
        assert torch.equal(got, ops.linear(x[:rows], packed.skinny, packed.bias, 150))
        assert torch.equal(got[-1], ops.linear(x[rows - 1:rows], packed.skinny, packed.bias, 150)[0])
    # leading dimensions are kept, as nn.Linear keeps them
    assert linear.packed_linear(torch.randn(2, 3, 96), packed).shape == (2, 3, 150)


def test_the_onednn_baseline_makes_its_copy_on_use_only(ops, monkeypatch):
    mod = torch.nn.Linear(96, 150)
    packed = linear.pack(mod)
    x = torch.randn(40, 96)
    monkeypatch.setattr(linear, "ONEDNN", True)
    assert not packed._onednn
    with torch.no_grad():
        assert torch.allclose(linear.packed_linear(x, packed), mod(x), atol=1e-5)
    assert packed._onednn


def _mapping_fields(addr: int) -> dict:
    """The /proc/self/smaps fields of the mapping that holds addr."""
    fields, inside = {}, False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head.endswith(":"):
            fields[head[:-1]] = line.split()[1]
    return fields


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux only")
def test_large_blocks_sit_on_their_own_huge_page_mapping(ops):
    """A pass streams every weight once: the blocks of a weight of 2 MiB or more start at a 2 MiB
    boundary of a mapping advised for transparent huge pages (fewer TLB misses, unbroken prefetch)."""
    w, b = weights(1024, 576)  # 2.25 MiB of blocks
    packed = ops.pack(w)
    assert packed.data_ptr() % (2 << 20) == 0
    thp = open("/sys/kernel/mm/transparent_hugepage/enabled").read() if os.path.exists(
        "/sys/kernel/mm/transparent_hugepage/enabled") else "[never]"
    if "[never]" not in thp:
        assert _mapping_fields(packed.data_ptr()).get("THPeligible") == "1"
    x = torch.randn(3, 576)
    assert torch.allclose(ops.linear(x, packed, b, 1024), x @ w.T + b, atol=1e-5)

"""The decoder's linear layers on CPU float32, with their weights packed once for fast products.

A decode pass or a verification window multiplies a few rows (1 to ~16) by every weight of the
model, and such a product is bound by reading the weights from memory; MKL's default `linear`
handles it about as if it ran once per row. csrc/skinny_linear.cpp reads each block of columns
in one forward stream for every row count (`python -m bench.linear`): a few rows as fast as
memory allows, a prompt pass as fast as oneDNN's own blocked layout, with one copy of the
weight and a row's result independent of the rows around it and of how many there are (a
prompt pass's KV equals a decode's). A weight whose values are all bfloat16 values is kept in
bfloat16 there (exact, half the bytes to read).

A weight kept in its file's blocks (blocks.BlockLinear) takes csrc/block_linear.cpp, which
widens each weight exactly and multiplies in skinny_linear's order: the float32 model's bits.

Where the compiled kernels are not built, oneDNN over its blocked copy takes every row count
(MKL's `linear` where this torch has no oneDNN); the products are the same up to float
summation order. `ONEDNN = True` sends every product through oneDNN (the benchmarks' baseline).

Sibling projections that transformers calls one after another on the same input (q/k/v,
gate/up) are fused: one product over their concatenated weights, each sibling taking its
columns. Fewer, wider products keep the cores busier (`python -m bench.linear`).

Applied from outside, gpt-fast style: the model code stays transformers' own, and the packed
path is taken only inside `PackedLinears.active()` (the engine's model call), so anything
else calling the same model (HF `generate` in the benchmarks) runs the stock layers.
Elsewhere (CUDA, other dtypes, a build without oneDNN) nothing changes.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import torch

from . import blocks, kernels
from .blocks import BlockLinear

PACK_ROWS = 8  # the row count oneDNN tunes the blocked layout for; measured best for 1-16 rows
ONEDNN = False  # True: every product through oneDNN over a widened copy (the benchmarks' baseline)
# children of one module that the model code calls in this order on one input tensor
FUSE = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


@dataclass(frozen=True)
class Packed:
    """One product's weight in the layout the CPU's products read, and its bias."""
    outputs: int
    skinny: torch.Tensor | None  # skinny_linear's blocks; None: the kernels are not built
    blocked: torch.Tensor | None  # oneDNN's layout, where the kernels are not built
    weight: torch.Tensor | None  # the plain float weight (the module's own tensor; None: blocks)
    bias: torch.Tensor | None
    format: int = 0  # 0: skinny holds float blocks; else they are blocks.py's, of this ggml type
    _onednn: dict = field(default_factory=dict, compare=False, repr=False)  # ONEDNN's copy, made on use

    def onednn(self) -> torch.Tensor:
        """oneDNN's blocked layout of the (widened) weight, kept once made: the baseline's."""
        if "w" not in self._onednn:
            dense = kernels.skinny().block_dense(self.skinny, self.format, self.outputs) if self.format else self.weight
            self._onednn["w"] = self.blocked if self.blocked is not None else \
                torch.ops.mkldnn._reorder_linear_weight(dense, PACK_ROWS)
        return self._onednn["w"]


def _packable(module: torch.nn.Module) -> bool:
    w = getattr(module, "weight", None)
    return (isinstance(module, torch.nn.Linear) and w is not None and w.device.type == "cpu"
            and w.dtype == torch.float32 and torch.backends.mkldnn.is_available())


def pack(module: torch.nn.Module) -> Packed | None:
    """A linear module's packed weight, or None where the fast path does not apply."""
    if isinstance(module, BlockLinear):
        return _pack_blocks(module.packed, module.format, module.out_features, module.bias)
    if not _packable(module):
        return None
    return _pack(module.weight.detach(), module.bias)


def _pack(weight: torch.Tensor, bias: torch.Tensor | None) -> Packed | None:
    ops = kernels.skinny()
    skinny = ops.pack(_narrowest(weight)) if ops is not None else None
    dnn = None
    if skinny is None:
        try:
            dnn = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS)
        except (AttributeError, RuntimeError):
            return None  # this torch build has no oneDNN linear: keep the stock layer
    return Packed(weight.shape[0], skinny, dnn, weight, None if bias is None else bias.detach())


def _pack_blocks(packed: torch.Tensor, ggml: int, outputs: int, bias: torch.Tensor | None) -> Packed:
    return Packed(outputs, packed, None, None, None if bias is None else bias.detach(), ggml)


def _narrowest(weight: torch.Tensor) -> torch.Tensor:
    """The weight as bfloat16 where that is exact (every value a bfloat16 value: a checkpoint
    stored in bfloat16, such as a draft head's): skinny_linear then reads half the bytes and gives
    the same bits."""
    narrow = weight.to(torch.bfloat16)
    return narrow if torch.equal(narrow.to(weight.dtype), weight) else weight


def packed_linear(x: torch.Tensor, packed: Packed) -> torch.Tensor:
    lead = x.shape[:-1]
    x = x.reshape(-1, x.shape[-1])
    if ONEDNN or packed.skinny is None:
        y = torch.ops.mkldnn._linear_pointwise(x, packed.onednn(), packed.bias, "none", [], "")
    elif packed.format:
        y = kernels.skinny().block_linear(x, packed.skinny, packed.format, packed.bias, packed.outputs)
    else:
        y = kernels.skinny().linear(x, packed.skinny, packed.bias, packed.outputs)
    return y.view(*lead, y.shape[-1])


class FusedGroup:
    """Sibling linears that read one input: the first sibling's call computes every sibling's
    output in one product, and each sibling then takes its own columns. A sibling called on
    another tensor, or twice, recomputes, so the result never depends on the call order."""

    def __init__(self, mods: list[torch.nn.Module], packed: Packed):
        self.packed = packed
        self.sizes = [m.out_features for m in mods]
        self.clear()

    @classmethod
    def of(cls, mods: list[torch.nn.Module]) -> FusedGroup | None:
        if len({m.in_features for m in mods}) != 1:
            return None
        biases = [m.bias for m in mods]
        bias = None if all(b is None for b in biases) else torch.cat(
            [b.detach() if b is not None else torch.zeros(m.out_features, dtype=torch.float32)
             for b, m in zip(biases, mods)])
        if all(isinstance(m, BlockLinear) for m in mods):
            return cls._of_blocks(mods, bias)
        if not all(_packable(m) for m in mods):
            return None
        packed = _pack(torch.cat([m.weight.detach() for m in mods]), bias)
        return None if packed is None else cls(mods, packed)

    @classmethod
    def _of_blocks(cls, mods: list[BlockLinear], bias: torch.Tensor | None) -> FusedGroup | None:
        """Siblings in one block format whose outputs fill whole column blocks: their blocks side
        by side are the fused weight's, and each sibling then reads its slice of them (one copy)."""
        if len({m.format for m in mods}) != 1 or any(m.out_features % blocks.columns(m.format) for m in mods):
            return None
        fused = torch.cat([m.packed for m in mods])
        start = 0
        for m in mods:
            m.packed = fused[start:start + m.packed.shape[0]]
            start += m.packed.shape[0]
        return cls(mods, _pack_blocks(fused, mods[0].format, sum(m.out_features for m in mods), bias))

    def clear(self) -> None:
        self._x: torch.Tensor | None = None
        self._parts: list = []

    def take(self, i: int, x: torch.Tensor) -> torch.Tensor:
        if self._x is not x or self._parts[i] is None:
            self._x, self._parts = x, list(packed_linear(x, self.packed).split(self.sizes, -1))
        part, self._parts[i] = self._parts[i], None
        if all(p is None for p in self._parts):
            self.clear()  # drop the reference to the input
        return part


class PackedLinears:
    """Every `nn.Linear` under `root` gets a packed copy of its weight and a forward that uses it
    while `active()`; `count` is how many were packed (0 where the fast path does not apply).
    `enabled = False` turns the fast path off (the benchmark's baseline)."""

    def __init__(self, root: torch.nn.Module):
        self._on = False
        self.enabled = True
        self.count = 0
        self.groups: list[FusedGroup] = []
        for parent in root.modules():
            for names in FUSE:
                mods = [getattr(parent, n, None) for n in names]
                if not all(isinstance(m, (torch.nn.Linear, BlockLinear)) for m in mods):
                    continue
                group = getattr(mods[0], "_pie_group", (None,))[0] or FusedGroup.of(mods)
                if group is None:
                    continue
                self.groups.append(group)
                for i, m in enumerate(mods):
                    m._pie_group = (group, i)
                    m._pie_stock = getattr(m, "_pie_stock", m.forward)
                    m.forward = self._fused(m._pie_stock, group, i)
                    self.count += 1
        for m in root.modules():
            if hasattr(m, "_pie_group"):
                continue
            # a model opened by a second engine keeps its one packed copy and its stock forward
            packed = getattr(m, "_pie_packed", None)
            packed = pack(m) if packed is None else packed
            if packed is not None:
                m._pie_packed = packed
                m._pie_stock = getattr(m, "_pie_stock", m.forward)
                m.forward = self._forward(m._pie_stock, packed)
                self.count += 1

    def _forward(self, stock, packed: Packed):

        def forward(x: torch.Tensor) -> torch.Tensor:
            return packed_linear(x, packed) if self._on else stock(x)

        return forward

    def _fused(self, stock, group: FusedGroup, i: int):

        def forward(x: torch.Tensor) -> torch.Tensor:
            return group.take(i, x) if self._on else stock(x)

        return forward

    @property
    def on(self) -> bool:
        """Whether the packed products are in use now (inside `active()`, and enabled)."""
        return self._on

    @staticmethod
    def parts(mods: list[torch.nn.Module]) -> list[Packed] | None:
        """The packed weights whose products, side by side, are the sibling linears' outputs: their
        fused group's one, or each sibling's own where they could not be fused (siblings in other
        block formats, as a Q4_K_M file's Q6_K values beside Q4_K queries); None: not all packed."""
        group = getattr(mods[0], "_pie_group", (None,))[0]
        if group is not None and [getattr(m, "_pie_group", None) for m in mods] == [(group, i) for i in range(len(group.sizes))]:
            return [group.packed]
        own = [getattr(m, "_pie_packed", None) for m in mods]
        return None if any(p is None for p in own) else own

    def product(self, mods: list[torch.nn.Module]) -> Callable[[torch.Tensor], torch.Tensor]:
        """x -> the sibling linears' outputs side by side, as one tensor: the packed products of
        `parts` while `active()`, else the stock layers."""
        parts = self.parts(mods)
        stocks = [getattr(m, "_pie_stock", m.forward) for m in mods]

        def stock(x: torch.Tensor) -> torch.Tensor:
            return stocks[0](x) if len(stocks) == 1 else torch.cat([f(x) for f in stocks], -1)

        if parts is None:
            return stock
        if len(parts) == 1:
            fast = functools.partial(packed_linear, packed=parts[0])
        else:
            def fast(x: torch.Tensor) -> torch.Tensor:
                return torch.cat([packed_linear(x, p) for p in parts], -1)
        return lambda x: fast(x) if self._on else stock(x)

    @contextmanager
    def active(self):
        self._on = self.enabled
        try:
            yield
        finally:
            self._on = False
            for g in self.groups:
                g.clear()

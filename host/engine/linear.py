"""The decoder's linear layers on CPU float32, through oneDNN with prepacked weights.

A verify window or a batch of decode rows multiplies a few rows (2 to ~16) by every weight
of the model. MKL's default `linear` handles that skinny product about as if it ran once per
row, so a 2-row pass cost ~1.5x a 1-row pass on this machine although the pass is bound by
reading the weights, which every row shares. oneDNN's matmul over weights reordered once into
its blocked layout reads them once: measured with `python -m bench.linear`. The product is the
same up to float summation order.

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
from typing import Callable

import torch

PACK_ROWS = 8  # the row count oneDNN tunes the blocked layout for; measured best for 1-16 rows
# children of one module that the model code calls in this order on one input tensor
FUSE = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _packable(module: torch.nn.Module) -> bool:
    w = getattr(module, "weight", None)
    return (isinstance(module, torch.nn.Linear) and w is not None and w.device.type == "cpu"
            and w.dtype == torch.float32 and torch.backends.mkldnn.is_available())


def pack(module: torch.nn.Module) -> torch.Tensor | None:
    """oneDNN's blocked copy of a linear module's weight, or None where the fast path does not apply."""
    return _pack(module.weight.detach()) if _packable(module) else None


def _pack(weight: torch.Tensor) -> torch.Tensor | None:
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS)
    except (AttributeError, RuntimeError):
        return None  # this torch build has no oneDNN linear: keep the stock layer


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    lead = x.shape[:-1]
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed, bias, "none", [], "")
    return y.view(*lead, y.shape[-1])


class FusedGroup:
    """Sibling linears that read one input: the first sibling's call computes every sibling's
    output in one product, and each sibling then takes its own columns. A sibling called on
    another tensor, or twice, recomputes, so the result never depends on the call order."""

    def __init__(self, mods: list[torch.nn.Module], packed: torch.Tensor):
        self.packed = packed
        self.sizes = [m.out_features for m in mods]
        biases = [m.bias for m in mods]
        self.bias = None if all(b is None for b in biases) else torch.cat(
            [b.detach() if b is not None else torch.zeros(n, dtype=packed.dtype) for b, n in zip(biases, self.sizes)])
        self.clear()

    @classmethod
    def of(cls, mods: list[torch.nn.Module]) -> FusedGroup | None:
        if len({m.in_features for m in mods}) != 1 or not all(_packable(m) for m in mods):
            return None
        packed = _pack(torch.cat([m.weight.detach() for m in mods]))
        return None if packed is None else cls(mods, packed)

    def clear(self) -> None:
        self._x: torch.Tensor | None = None
        self._parts: list = []

    def take(self, i: int, x: torch.Tensor) -> torch.Tensor:
        if self._x is not x or self._parts[i] is None:
            self._x, self._parts = x, list(packed_linear(x, self.packed, self.bias).split(self.sizes, -1))
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
                if not all(isinstance(m, torch.nn.Linear) for m in mods):
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
                m.forward = self._forward(m._pie_stock, packed, m.bias)
                self.count += 1

    def _forward(self, stock, packed: torch.Tensor, bias: torch.Tensor | None):

        def forward(x: torch.Tensor) -> torch.Tensor:
            return packed_linear(x, packed, bias) if self._on else stock(x)

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
    def packed(mods: list[torch.nn.Module]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The packed weight and bias of the sibling linears' one product, or None: not packed."""
        group = getattr(mods[0], "_pie_group", (None,))[0]
        if group is not None and [getattr(m, "_pie_group", None) for m in mods] == [(group, i) for i in range(len(group.sizes))]:
            return group.packed, group.bias
        if len(mods) == 1 and getattr(mods[0], "_pie_packed", None) is not None:
            return mods[0]._pie_packed, mods[0].bias
        return None

    def product(self, mods: list[torch.nn.Module]) -> Callable[[torch.Tensor], torch.Tensor]:
        """x -> the sibling linears' outputs side by side, as one tensor: the packed product of
        their fused group (or of the one packed layer) while `active()`, else the stock layers."""
        wb = self.packed(mods)
        fast = None if wb is None else functools.partial(packed_linear, packed=wb[0], bias=wb[1])
        stocks = [getattr(m, "_pie_stock", m.forward) for m in mods]

        def stock(x: torch.Tensor) -> torch.Tensor:
            return stocks[0](x) if len(stocks) == 1 else torch.cat([f(x) for f in stocks], -1)

        if fast is None:
            return stock
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

"""The decoder's linear layers on CPU float32, through oneDNN with prepacked weights.

A verify window or a batch of decode rows multiplies a few rows (2 to ~16) by every weight
of the model. MKL's default `linear` handles that skinny product about as if it ran once per
row, so a 2-row pass cost ~1.5x a 1-row pass on this machine although the pass is bound by
reading the weights, which every row shares. oneDNN's matmul over weights reordered once into
its blocked layout reads them once: measured with `python -m bench.linear`. The product is the
same up to float summation order.

Applied from outside, gpt-fast style: the model code stays transformers' own, and the packed
path is taken only inside `PackedLinears.active()` (the engine's model call), so anything
else calling the same model (HF `generate` in the benchmarks) runs the stock layers.
Elsewhere (CUDA, other dtypes, a build without oneDNN) nothing changes.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

PACK_ROWS = 8  # the row count oneDNN tunes the blocked layout for; measured best for 1-16 rows


def _packable(module: torch.nn.Module) -> bool:
    w = getattr(module, "weight", None)
    return (isinstance(module, torch.nn.Linear) and w is not None and w.device.type == "cpu"
            and w.dtype == torch.float32 and torch.backends.mkldnn.is_available())


def pack(module: torch.nn.Module) -> torch.Tensor | None:
    """oneDNN's blocked copy of a linear module's weight, or None where the fast path does not apply."""
    if not _packable(module):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), PACK_ROWS)
    except (AttributeError, RuntimeError):
        return None  # this torch build has no oneDNN linear: keep the stock layer


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    lead = x.shape[:-1]
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed, bias, "none", [], "")
    return y.view(*lead, y.shape[-1])


class PackedLinears:
    """Every `nn.Linear` under `root` gets a packed copy of its weight and a forward that uses it
    while `active()`; `count` is how many were packed (0 where the fast path does not apply).
    `enabled = False` turns the fast path off (the benchmark's baseline)."""

    def __init__(self, root: torch.nn.Module):
        self._on = False
        self.enabled = True
        self.count = 0
        for m in root.modules():
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

    @contextmanager
    def active(self):
        self._on = self.enabled
        try:
            yield
        finally:
            self._on = False

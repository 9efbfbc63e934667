"""Weights kept in their file's block format (GGUF's Q8_0, Q4_0, Q4_1), for csrc/block_linear.cpp.

A GGUF row of K weights is K / 32 blocks, each a few float16 scales and 32 quants. The kernel
reads them repacked to skinny_linear's column blocks: for each `SkinnyOps.block` outputs and
32 k, the outputs' scales side by side, then each k's quants side by side (`repack`). It widens
each weight with gguf-py's own formula, exactly, so a product over blocks has the bits of the
float32 kernel over `gguf.quants.dequantize` (tests/test_block_linear.py).

Only this module knows the block layouts; everything else names a format by its ggml type.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP = 32  # weights along a row one block covers, in every format here


@dataclass(frozen=True)
class Format:
    name: str
    ggml: int  # gguf.GGMLQuantizationType's number, the kernel's format argument
    scales: int  # float16 scales a block starts with: d, or d then m
    bits: int  # bits a quant

    @property
    def block_bytes(self) -> int:
        """A GGUF block: its scales, then 32 quants."""
        return 2 * self.scales + GROUP * self.bits // 8


FORMATS = {f.ggml: f for f in (Format("Q4_0", 2, 1, 4), Format("Q4_1", 3, 2, 4), Format("Q8_0", 8, 1, 8))}


def format_of(ggml: int) -> Format | None:
    """The format a ggml type number names, None where there is no kernel for it."""
    return FORMATS.get(ggml)


def repack(raw: torch.Tensor, ggml: int, block: int) -> torch.Tensor:
    """A GGUF tensor's bytes, [N, K / 32 * block_bytes] uint8 (a weight's rows), as the kernel's
    [ceil(N / block), K / 32, group bytes]: the `block` columns' scales (each scale in turn,
    float16 bytes), then for each of the 32 k its `block` quants (4-bit ones two a byte: column
    c's low nibble, column c + block / 2's high one). Missing columns are zero blocks."""
    fmt = FORMATS[ggml]
    n, row_bytes = raw.shape
    if raw.dtype != torch.uint8 or row_bytes % fmt.block_bytes:
        raise ValueError(f"{fmt.name}: rows of {row_bytes} bytes are not whole {fmt.block_bytes}-byte blocks")
    groups, nb = row_bytes // fmt.block_bytes, -(-n // block)
    padded = torch.zeros(nb * block, groups, fmt.block_bytes, dtype=torch.uint8)
    padded[:n] = raw.view(n, groups, fmt.block_bytes)
    g = padded.view(nb, block, groups, fmt.block_bytes).permute(0, 2, 1, 3)  # [nb, G, block, bytes]
    head = 2 * fmt.scales
    parts = [g[..., 2 * s:2 * s + 2].reshape(nb, groups, 2 * block) for s in range(fmt.scales)]
    qs = g[..., head:]
    if fmt.bits == 8:
        q = qs  # [nb, G, block, 32]
    else:  # gguf's quant i < 16 is byte i's low nibble, quant i + 16 its high one
        q = torch.cat([qs & 0x0F, qs >> 4], -1)
    q = q.transpose(-1, -2)  # [nb, G, 32, block]
    if fmt.bits == 4:
        q = q[..., :block // 2] | (q[..., block // 2:] << 4)
    parts.append(q.reshape(nb, groups, -1))
    return torch.cat(parts, -1).contiguous()


def dequantize(raw: torch.Tensor, ggml: int) -> torch.Tensor:
    """A GGUF tensor's bytes [N, row bytes] as float32 [N, K], with gguf-py's formulas in torch:
    the same float32s as gguf.quants.dequantize (where the kernels are not built, or off the CPU)."""
    fmt = FORMATS[ggml]
    n = raw.shape[0]
    b = raw.reshape(n, -1, fmt.block_bytes)
    d = b[..., 0:2].contiguous().view(torch.float16).float()
    qs = b[..., 2 * fmt.scales:]
    if fmt.bits == 8:
        return (d * qs.contiguous().view(torch.int8).float()).reshape(n, -1)
    q = torch.cat([qs & 0x0F, qs >> 4], -1).float()
    if fmt.scales == 2:  # Q4_1: d * q is exact, so one rounding, as gguf's (d * q) + m
        return (d * q + b[..., 2:4].contiguous().view(torch.float16).float()).reshape(n, -1)
    return (d * (q - 8)).reshape(n, -1)


class BlockLinear(torch.nn.Module):
    """nn.Linear's product over a weight in the kernel's blocks (`repack`). linear.py packs it for
    the fast products; called as a plain module it widens its weight first (exactly)."""

    def __init__(self, packed: torch.Tensor, ggml: int, out_features: int, in_features: int,
                 bias: torch.Tensor | None = None):
        super().__init__()
        self.packed, self.format = packed, ggml
        self.out_features, self.in_features = out_features, in_features
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:
        """The weight widened to float32 [out, in]: a new tensor each time."""
        return _ops().block_dense(self.packed, self.format, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight.to(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return f"{FORMATS[self.format].name}, in_features={self.in_features}, out_features={self.out_features}"


class BlockEmbedding(torch.nn.Module):
    """nn.Embedding over rows in the kernel's blocks: each id's row widened where it is read. A
    tied readout (`BlockLinear`) streams the same blocks: one copy."""

    def __init__(self, packed: torch.Tensor, ggml: int, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.packed, self.format = packed, ggml
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim

    @property
    def weight(self) -> torch.Tensor:
        return _ops().block_dense(self.packed, self.format, self.num_embeddings)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = _ops().block_gather(self.packed, self.format, self.num_embeddings, ids.reshape(-1).long())
        return rows.view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{FORMATS[self.format].name}, {self.num_embeddings}, {self.embedding_dim}"


def _ops():
    from . import kernels

    ops = kernels.skinny()
    if ops is None:
        raise RuntimeError("weights in blocks need the CPU kernels (host/engine/kernels.py)")
    return ops


def usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a model on `device` in `dtype` can keep weights in blocks (else they are widened
    at load): the CPU kernels compute in float32."""
    from . import kernels

    return device.type == "cpu" and dtype == torch.float32 and kernels.skinny() is not None


def install(model: torch.nn.Module, name: str, raw: torch.Tensor, ggml: int,
            bias: torch.Tensor | None = None) -> torch.nn.Module:
    """Replace the nn.Linear or nn.Embedding whose weight `name` is with its block module over
    the GGUF rows `raw` (and a linear's bias), and return the new module."""
    path, _, leaf = name.rpartition(".")
    if leaf != "weight":
        raise ValueError(f"{name}: only a layer's weight is kept in blocks")
    parent_name, _, child = path.rpartition(".")
    parent = model.get_submodule(parent_name)
    old = getattr(parent, child)
    packed = repack(raw, ggml, _ops().block)
    if isinstance(old, torch.nn.Linear):
        new = BlockLinear(packed, ggml, old.out_features, old.in_features, bias)
    elif isinstance(old, torch.nn.Embedding):
        new = BlockEmbedding(packed, ggml, old.num_embeddings, old.embedding_dim)
    else:
        raise ValueError(f"{name}: a {type(old).__name__} cannot read blocks")
    setattr(parent, child, new)
    return new


def tie(head: torch.nn.Module, embedding: BlockEmbedding) -> BlockLinear:
    """The readout over a tied embedding's own blocks (no copy)."""
    return BlockLinear(embedding.packed, embedding.format, embedding.num_embeddings, embedding.embedding_dim,
                       None if getattr(head, "bias", None) is None or head.bias.is_meta else head.bias.detach())

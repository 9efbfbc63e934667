"""Weights kept in their file's block format (GGUF's Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K) or as a
checkpoint's bfloat16 or float16, for csrc/block_linear.cpp.

A GGUF row of K weights is K / 32 blocks (K / 256 super-blocks for the K-quants), each some
scales and its quants. `groups` reads a file's blocks as the kernel's groups: for each group of
k that shares scales (32; 16 for Q6_K), its scales (a legacy block's float16 d and m; a
K-quant's super-block scale times the group's own, as float32, exactly as gguf-py computes
them) and its quants as small integers. `repack` lays them out as skinny_linear's column blocks:
for each `SkinnyOps.block` outputs and group, the outputs' scales side by side, then each k's
quants side by side. The kernel widens each weight with gguf-py's own formula, exactly, so a
product over blocks has the bits of the float32 kernel over `gguf.quants.dequantize`
(tests/test_block_linear.py).

A second arithmetic, chosen explicitly per model (`pie model import --activations q8`), reads the
blocks of Q4_0, Q4_1, Q8_0 and the K-quants with 8-bit activations (csrc/q8_linear.cpp): its format number is Q8_ACTIVATIONS + the
ggml type, its layout `repack_q8`'s. It is not the float32 product of the dequantized weight.

Only this module knows the block layouts; everything else names a format by its number.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

Groups = tuple[list[torch.Tensor], torch.Tensor]  # scales [N, G] each, quants [N, G, group] (uint8; int16 16-bit floats)


@dataclass(frozen=True)
class Format:
    """A GGUF block format the kernel reads: the file's blocks, and the kernel's groups."""
    name: str
    ggml: int  # gguf.GGMLQuantizationType's number, the kernel's format argument
    block_weights: int  # weights along a row one file block holds
    block_bytes: int  # bytes a file block takes
    float16_at: tuple[int, ...]  # offsets of a file block's float16 scales
    group: int  # k one set of the kernel's scales covers
    bits: int  # bits the kernel stores a quant in: 4 (two a byte), 8 (int8) or 16 (a 16-bit float)
    unpack: Callable[[torch.Tensor], Groups]  # [N, blocks, block_bytes] uint8 -> the kernel's groups
    offset: int = 0  # what a quant's value is less: w = d * (q - offset)


def _f16(b: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at byte `at` of each block, as float32 (exact)."""
    return b[..., at:at + 2].contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """A legacy block's 16 bytes as its 32 quants: quant i < 16 is byte i's low nibble, i + 16 its high one."""
    return torch.cat([qs & 0x0F, qs >> 4], -1)


def _legacy(scales: int, bits: int) -> Callable[[torch.Tensor], Groups]:
    def unpack(b: torch.Tensor) -> Groups:
        qs = b[..., 2 * scales:]
        return [_f16(b, 2 * s).half() for s in range(scales)], (qs if bits == 8 else _nibbles(qs)).contiguous()
    return unpack


def _k_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's and Q5_K's 12 bytes of 6-bit scales and mins, as gguf-py's get_scale_min: [N, B, 8] each."""
    s = b[..., 4:16].reshape(*b.shape[:-1], 3, 4)
    d, m, md = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], -1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], -1)
    return sc, mn


def _k_dm(b: torch.Tensor) -> list[torch.Tensor]:
    """A Q4_K/Q5_K group's scale d * sc and negated min -(dmin * m): float32 [N, B * 8], each exact."""
    sc, mn = _k_scales(b)
    d = _f16(b, 0)[..., None] * sc.float()
    m = _f16(b, 2)[..., None] * mn.float()
    return [d.flatten(-2), (-m).flatten(-2)]


def _low_high(qs: torch.Tensor, span: int) -> torch.Tensor:
    """Quants stored as low then high nibbles of each `span`-byte run: [..., runs * 2, span]."""
    q = qs.reshape(*qs.shape[:-1], -1, 1, span)
    return torch.cat([q & 0x0F, q >> 4], -2).flatten(-3, -2)


def _q4_k(b: torch.Tensor) -> Groups:
    n, nb = b.shape[:2]
    return _k_dm(b), _low_high(b[..., 16:144], 32).reshape(n, nb * 8, 32)


def _q5_k(b: torch.Tensor) -> Groups:
    n, nb = b.shape[:2]
    low = _low_high(b[..., 48:176], 32)  # [N, B, 8, 32]
    qh = b[..., 16:48]  # bit s of byte i: quant i's fifth bit in group s
    high = torch.stack([(qh >> s) & 1 for s in range(8)], -2)
    return _k_dm(b), (low | (high << 4)).reshape(n, nb * 8, 32)


def _q6_k(b: torch.Tensor) -> Groups:
    n, nb = b.shape[:2]
    low = _low_high(b[..., 0:128], 64).reshape(n, nb, 8, 32)  # 2 runs of 64 bytes, low then high nibbles
    qh = b[..., 128:192].reshape(n, nb, 2, 1, 32)
    high = torch.cat([(qh >> s) & 3 for s in (0, 2, 4, 6)], -2).reshape(n, nb, 8, 32)
    q = ((low | (high << 4)).to(torch.int16) - 32).to(torch.int8).view(torch.uint8)
    d = _f16(b, 208)[..., None] * b[..., 192:208].contiguous().view(torch.int8).float()  # [N, B, 16]
    return [d.flatten(-2)], q.reshape(n, nb * 16, 16)


def _wide16(b: torch.Tensor) -> Groups:
    """Rows of 16-bit floats as groups of 32: no scales, the values' bits as int16."""
    n, nb = b.shape[:2]
    return [], b.contiguous().view(torch.int16).reshape(n, nb, 32)


FORMATS = {f.ggml: f for f in (
    Format("Q4_0", 2, 32, 18, (0,), 32, 4, _legacy(1, 4), offset=8),
    Format("Q4_1", 3, 32, 20, (0, 2), 32, 4, _legacy(2, 4)),
    Format("Q8_0", 8, 32, 34, (0,), 32, 8, _legacy(1, 8)),
    Format("Q4_K", 12, 256, 144, (0, 2), 32, 4, _q4_k),
    Format("Q5_K", 13, 256, 176, (0, 2), 32, 8, _q5_k),
    Format("Q6_K", 14, 256, 210, (208,), 16, 8, _q6_k),
    # a checkpoint's bfloat16 or float16 weights (GGUF's F16 and BF16 too), kept as stored; rows
    # of whole 32-weight groups
    Format("F16", 1, 32, 64, (), 32, 16, _wide16),
    Format("BF16", 30, 32, 64, (), 32, 16, _wide16),
)}
WIDE16 = {torch.float16: 1, torch.bfloat16: 30}  # a 16-bit float dtype's format
GGML = {f.name: g for g, f in FORMATS.items()}  # a format's ggml type by its name
Q8_ACTIVATIONS = 256  # + a ggml type: its blocks read with 8-bit activations (csrc/q8_linear.cpp)
Q8_KERNELS = (2, 3, 8, 12, 13, 14)  # the ggml types that have such a kernel: Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K


def ggml_of(format: int) -> int:
    """The ggml type of a format number (the file's blocks it reads)."""
    return format - Q8_ACTIVATIONS if format >= Q8_ACTIVATIONS else format


def name(format: int) -> str:
    """A format number's name: the ggml type's, with `+q8` for 8-bit activations."""
    return FORMATS[ggml_of(format)].name + ("+q8" if format >= Q8_ACTIVATIONS else "")


def q8_format(ggml: int) -> int:
    """The format number that reads a ggml type's blocks with 8-bit activations where the type has
    that kernel (Q8_KERNELS), else its exact one."""
    return Q8_ACTIVATIONS + ggml if ggml in Q8_KERNELS else ggml


def format_of(ggml: int) -> Format | None:
    """The format a ggml type number names, None where there is no kernel for it."""
    return FORMATS.get(ggml)


def groups(raw: torch.Tensor, ggml: int) -> Groups:
    """A GGUF tensor's bytes, [N, row bytes] uint8 (a weight's rows), as the kernel's groups."""
    fmt = FORMATS[ggml]
    n, row_bytes = raw.shape
    if raw.dtype != torch.uint8 or row_bytes % fmt.block_bytes:
        raise ValueError(f"{fmt.name}: rows of {row_bytes} bytes are not whole {fmt.block_bytes}-byte blocks")
    return fmt.unpack(raw.view(n, row_bytes // fmt.block_bytes, fmt.block_bytes))


def _columns(g: Groups, block: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Groups in column blocks of `block`, what both layouts start from: each scale's bytes as
    [nb, G, block * scale bytes], and the quants as [nb, G, block, group] (nb = ceil(N / block);
    missing columns zero)."""
    scales, q = g
    n, groups_ = q.shape[:2]
    nb = -(-n // block)

    def blocked(t: torch.Tensor) -> torch.Tensor:  # [N, G, ...] -> [nb, G, block, ...], zero-padded
        padded = torch.zeros(nb * block, *t.shape[1:], dtype=t.dtype)
        padded[:n] = t
        return padded.view(nb, block, *t.shape[1:]).transpose(1, 2)

    return [blocked(s).contiguous().view(torch.uint8).reshape(nb, groups_, -1) for s in scales], blocked(q)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """_columns' [nb, G, block, ...] back to [nb * block, G, ...]."""
    return t.transpose(1, 2).reshape(t.shape[0] * t.shape[2], t.shape[1], *t.shape[3:])


def _kinds(ggml: int) -> tuple[list[torch.dtype], torch.dtype]:
    """The dtypes of a format's groups: each scale's, and the quants'."""
    fmt = FORMATS[ggml]
    scales, q = fmt.unpack(torch.zeros(1, 1, fmt.block_bytes, dtype=torch.uint8))
    return [x.dtype for x in scales], q.dtype


def _lay_out(g: Groups, ggml: int, block: int, q8: bool) -> torch.Tensor:
    """Groups in the exact layout (`repack`) or the 8-bit-activation one (`repack_q8`)."""
    fmt = FORMATS[ggml]
    parts, q = _columns(g, block)  # q: [nb, G, block, group]
    nb, groups_ = q.shape[:2]
    if q8:
        if fmt.bits == 4:
            q = q.reshape(nb, groups_, block, 2, 4, 4)  # k = 16 * half + 4 * run + t
            q = q[:, :, :, 0] | (q[:, :, :, 1] << 4)  # [nb, G, block, run, t]
        else:
            q = q.reshape(nb, groups_, block, fmt.group // 4, 4)
        q = q.transpose(2, 3)  # [nb, G, run, block, t]
    else:
        q = q.transpose(-1, -2)  # [nb, G, group, block]
        if fmt.bits == 4:
            q = q[..., :block // 2] | (q[..., block // 2:] << 4)
    parts.append(q.contiguous().view(torch.uint8).reshape(nb, groups_, -1))
    return torch.cat(parts, -1).contiguous()


def _read_back(packed: torch.Tensor, format: int) -> Groups:
    """A packed weight's groups, every column of its blocks a row (`_lay_out` undone)."""
    ggml, q8 = ggml_of(format), format >= Q8_ACTIVATIONS
    fmt, block = FORMATS[ggml], columns(format)
    scale_kinds, q_kind = _kinds(ggml)
    nb, groups_ = packed.shape[:2]
    scales, at = [], 0
    for kind in scale_kinds:
        size = block * kind.itemsize
        raw = packed[..., at:at + size].reshape(nb, groups_, block, kind.itemsize)
        scales.append(_rows(raw).contiguous().view(kind).squeeze(-1))
        at += size
    q = packed[..., at:]
    if q8:
        q = q.reshape(nb, groups_, -1, block, 4).transpose(2, 3)  # [nb, G, block, run, t]
        if fmt.bits == 4:
            q = torch.stack([q & 0x0F, q >> 4], 3)  # [nb, G, block, half, run, t]
        q = q.reshape(nb, groups_, block, fmt.group)
    else:
        q = q.reshape(nb, groups_, fmt.group, -1)
        if fmt.bits == 4:
            q = torch.cat([q & 0x0F, q >> 4], -1)
        q = q.contiguous().view(q_kind).transpose(-1, -2)  # [nb, G, block, group]
    return scales, _rows(q).contiguous()


def repack(raw: torch.Tensor, ggml: int, block: int) -> torch.Tensor:
    """A GGUF tensor's bytes, [N, row bytes] uint8, as the kernel's [ceil(N / block), G, group
    bytes]: the `block` columns' scales (each scale in turn, its bytes), then for each k of the
    group its `block` quants (4-bit ones two a byte: column c's low nibble, column c + block / 2's
    high one). Missing columns are zero."""
    return _lay_out(groups(raw, ggml), ggml, block, q8=False)


def repack_q8(raw: torch.Tensor, ggml: int, block: int) -> torch.Tensor:
    """A GGUF tensor's bytes, [N, row bytes] uint8, as csrc/q8_linear.cpp's [ceil(N / block), G,
    group bytes]: the `block` columns' scales (d, then m; `groups`' own: float16 for the legacy
    formats, float32 for the K-quants), then the group's quants four k at a time, each column's
    four side by side: byte quants as group / 4 runs of k 4p..4p+3; 4-bit ones as 4 runs, k
    4p..4p+3 in the low nibbles and 4p+16..4p+19 in the high ones. Missing columns are zero."""
    if ggml not in Q8_KERNELS:
        raise ValueError(f"{FORMATS[ggml].name} has no kernel with 8-bit activations")
    return _lay_out(groups(raw, ggml), ggml, block, q8=True)


def take_rows(packed: torch.Tensor, format: int, ids: torch.Tensor, into: int | None = None) -> torch.Tensor:
    """The rows `ids` of a packed weight (outputs of a linear, rows of an embedding), packed anew in
    format `into` (default: the same; the same file blocks in the other layout, e.g. a q8 format's
    exact one): the same widened weights (a draft head's readout over its draft vocabulary's rows
    of the target's)."""
    into = format if into is None else into
    if ggml_of(into) != ggml_of(format):
        raise ValueError(f"{name(format)} rows cannot be laid out as {name(into)}: another file format")
    scales, q = _read_back(packed, format)
    ids = torch.as_tensor(ids, dtype=torch.long)
    return _lay_out(([x[ids] for x in scales], q[ids]), ggml_of(into), columns(into), q8=into >= Q8_ACTIVATIONS)


def dequantize(raw: torch.Tensor, ggml: int) -> torch.Tensor:
    """A GGUF tensor's bytes [N, row bytes] as float32 [N, K], with gguf-py's formulas in torch:
    the same float32s as gguf.quants.dequantize (where the kernels are not built, or off the CPU)."""
    fmt = FORMATS[ggml]
    scales, q = groups(raw, ggml)
    n = q.shape[0]
    if fmt.bits == 16:
        return q.view(torch.bfloat16 if fmt.name == "BF16" else torch.float16).float().reshape(n, -1)
    d = scales[0].float()[..., None]
    if fmt.bits == 8:
        qf = q.view(torch.int8).float()
    else:
        qf = q.float() - fmt.offset
    if len(scales) == 2:  # d * q is exact: one rounding, as gguf's (d * q) + m and d * q - dm
        return (d * qf + scales[1].float()[..., None]).reshape(n, -1)
    return (d * qf).reshape(n, -1)


class BlockLinear(torch.nn.Module):
    """nn.Linear's product over a weight in the kernel's blocks (`repack`). linear.py packs it for
    the fast products; called as a plain module it widens its weight first (exactly)."""

    def __init__(self, packed: torch.Tensor, format: int, out_features: int, in_features: int,
                 bias: torch.Tensor | None = None):
        super().__init__()
        self.packed, self.format = packed, format  # a format number (ggml type, or + Q8_ACTIVATIONS)
        self.out_features, self.in_features = out_features, in_features
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:
        """The weight widened to float32 [out, in]: a new tensor each time."""
        return _ops().block_dense(self.packed, self.format, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight.to(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return f"{name(self.format)}, in_features={self.in_features}, out_features={self.out_features}"


class BlockEmbedding(torch.nn.Module):
    """nn.Embedding over rows in the kernel's blocks: each id's row widened where it is read. A
    tied readout (`BlockLinear`) streams the same blocks: one copy."""

    def __init__(self, packed: torch.Tensor, format: int, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.packed, self.format = packed, format  # a format number (ggml type, or + Q8_ACTIVATIONS)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim

    @property
    def weight(self) -> torch.Tensor:
        return _ops().block_dense(self.packed, self.format, self.num_embeddings)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = _ops().block_gather(self.packed, self.format, self.num_embeddings, ids.reshape(-1).long())
        return rows.view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{name(self.format)}, {self.num_embeddings}, {self.embedding_dim}"


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


def columns(format: int) -> int:
    """The output columns of one of the kernel's blocks for a format number."""
    return _ops().q8_block if format >= Q8_ACTIVATIONS else _ops().block


def pack(raw: torch.Tensor, format: int) -> torch.Tensor:
    """A GGUF tensor's bytes as the kernel's blocks for a format number."""
    if format >= Q8_ACTIVATIONS:
        return repack_q8(raw, ggml_of(format), columns(format))
    return repack(raw, format, columns(format))


def install(model: torch.nn.Module, weight: str, raw: torch.Tensor, ggml: int,
            bias: torch.Tensor | None = None, q8: bool = False) -> torch.nn.Module:
    """Replace the nn.Linear or nn.Embedding whose weight `weight` is with its block module over
    the GGUF rows `raw` (and a linear's bias), with 8-bit activations where `q8` and the format has
    them, and return the new module."""
    path, _, leaf = weight.rpartition(".")
    if leaf != "weight":
        raise ValueError(f"{weight}: only a layer's weight is kept in blocks")
    parent_name, _, child = path.rpartition(".")
    parent = model.get_submodule(parent_name)
    old = getattr(parent, child)
    format = q8_format(ggml) if q8 else ggml
    packed = pack(raw, format)
    if isinstance(old, torch.nn.Linear):
        new = BlockLinear(packed, format, old.out_features, old.in_features, bias)
    elif isinstance(old, torch.nn.Embedding):
        new = BlockEmbedding(packed, format, old.num_embeddings, old.embedding_dim)
    else:
        raise ValueError(f"{weight}: a {type(old).__name__} cannot read blocks")
    setattr(parent, child, new)
    return new


def from_linear(linear: torch.nn.Linear, ggml: int, q8: bool = False) -> BlockLinear:
    """A float linear as a block module of `ggml` (rows of whole 32-weight groups): Q8_0 as gguf-py's
    reference quantizer writes it (a draft head's block: its drafts may move, never the target's
    output), or F16/BF16 (exact where the weights are such floats); 8-bit activations where `q8`."""
    from gguf.quants import quantize

    w = linear.weight.detach().float().cpu()
    wide = next((dt for dt, g in WIDE16.items() if g == ggml), None)
    raw = w.to(wide).view(torch.uint8) if wide is not None else torch.from_numpy(quantize(w.numpy(), ggml))
    format = q8_format(ggml) if q8 else ggml
    bias = None if linear.bias is None else linear.bias.detach().float().cpu()
    return BlockLinear(pack(raw, format), format, linear.out_features, linear.in_features, bias)


def tie(head: torch.nn.Module, embedding: BlockEmbedding) -> BlockLinear:
    """The readout over a tied embedding's own blocks (no copy)."""
    return BlockLinear(embedding.packed, embedding.format, embedding.num_embeddings, embedding.embedding_dim,
                       None if getattr(head, "bias", None) is None or head.bias.is_meta else head.bias.detach())

"""The engine's paged attention: `attend`, which the layer stack (stack.py) calls, and the hook
registered with transformers' attention interface for the layers transformers runs itself.

Either way only the attention core is replaced: it writes the batch's new K/V rows into the
paged pool and attends each pass's queries to that pass's frozen rows plus its own window
(causally). Rows past a working set's frozen end from earlier passes are never in the context.

Where the engine's kernel is built (kernels.py: CPU, float32) every window attends with it: it
reads the context where it lies in the pool and computes each row alone, so a row's attention
is the same in a decode, a verification window and a prompt pass of any length (the logprobs of
an accepted draft, a prompt's cached KV). A prompt pass costs ~10% more than through SDPA
(768 rows on the Zen 4 VM, 2 threads: 1.27 s against 1.14 s). Without the kernel every window
goes through SDPA over a gathered copy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from .working_set import WorkingSet

NAME = "pie_paged"

# Windows up to this many rows are short: they share one attention call (padded to the longest
# under SDPA); a longer one (a prompt) gets its own, so it does not pad every decode row.
SMALL_WINDOW = 16

_NO_SLOTS = torch.empty(0, dtype=torch.long)


@dataclass
class Group:
    """Passes whose queries attend in one SDPA call (padded to the group's longest window)."""

    rows: torch.Tensor | None  # flat rows of the group's real queries, in order; None: the whole batch
    ctx_slots: torch.Tensor | None  # [B, Lmax] pool slots of each pass's context (padded)
    ctx_range: tuple[int, int] | None  # one pass whose context is one run of slots: a view, no gather
    q_index: torch.Tensor | None  # [B, Wmax] flat row of each padded query; None when `uniform`
    q_valid: torch.Tensor | None  # [B*Wmax] which padded queries are real rows
    mask: torch.Tensor | None  # [B, 1, Wmax, Lmax] bool; None for a single one-row pass, a causal one, or the kernel's
    causal: bool = False  # one pass over an empty context: SDPA's own causal mask, which skips the masked half
    # the whole batch, every window this many rows long (a lone pass, or a batch of decode rows):
    # the queries are the batch's rows in order, so they need no gather and no padding
    uniform: int | None = None
    # rows of the layer's pool, viewed [2 * kv_heads * slots, D], that hold the contexts' K and V:
    # made by the first layer, used by all (one gather along dim 0, which torch runs on every core)
    kv_rows: torch.Tensor | None = None
    # for the kernel: each pass's first flat row, window and frozen length
    passes: tuple[list[int], list[int], list[int]] | None = None
    # the kernel's arguments after the pool and query: made by the first layer, used by all
    plan: tuple | None = None


@dataclass
class BatchMeta:
    """Index tensors for one ragged batch, shared by every layer."""

    kv: torch.Tensor  # [layers, 2, kv_heads, slots, head_dim]: the whole pool (head-major: each head's
    # keys lie in one run, which a decode row's attention over a long context reads faster)
    slot_mapping: torch.Tensor  # [T] pool slot of each new row
    groups: list[Group]
    kernel: Callable | None = None  # kernels.paged_attention for every group, or None: SDPA


def make_group(dev, starts: list[int], windows: list[int], frozen: list[int], lengths: list[int],
               sets: list[WorkingSet], whole: bool, kernel: bool) -> Group:
    """Passes over the working sets `sets`, one each: lengths is each pass's context length
    (frozen + window); whole: the group is the entire batch; kernel: the windows attend with the
    engine's kernel (then they need no mask)."""
    b, wmax, lmax = len(windows), max(windows), max(lengths)
    run = sets[0].slot_run(lengths[0]) if b == 1 else None  # one run of slots: attention reads a view
    ctx_t = None
    if run is None:
        ctx = [ws.slots(0, n) for ws, n in zip(sets, lengths)]
        ctx_t = torch.tensor([c + [0] * (lmax - len(c)) for c in ctx], device=dev)
    mask = q_index = q_valid = rows = None
    causal = b == 1 and wmax > 1 and frozen[0] == 0
    if (b > 1 or wmax > 1) and not causal and not kernel:
        fz = torch.tensor(frozen, device=dev)
        cl = torch.tensor(lengths, device=dev)
        qi = torch.arange(wmax, device=dev)
        kj = torch.arange(lmax, device=dev)
        # key j is visible to window row i iff j <= frozen + i (causal), and j is a real row
        mask = (kj[None, None, :] <= fz[:, None, None] + qi[None, :, None]) & (kj[None, None, :] < cl[:, None, None])
        mask = mask.unsqueeze(1)
    uniform = wmax if whole and min(windows) == wmax else None
    if uniform is None:
        wl = torch.tensor(windows, device=dev)
        st = torch.tensor(starts, device=dev)
        qi = torch.arange(wmax, device=dev)
        valid = qi[None, :] < wl[:, None]
        q_index = torch.where(valid, st[:, None] + qi[None, :], 0)
        q_valid = valid.flatten()
        if not whole:
            rows = q_index.flatten()[q_valid]
    return Group(rows, ctx_t, run, q_index, q_valid, mask, causal, uniform,
                 passes=(starts, windows, frozen) if kernel else None)


def _attend(g: Group, kv, query, scaling):
    """kv: the layer's pool, [2, kv_heads, slots, D]."""
    if g.ctx_range is not None:
        a, b = g.ctx_range
        k = kv[0, :, a:b].unsqueeze(0)  # [1, kv_heads, L, D]
        v = kv[1, :, a:b].unsqueeze(0)
    else:
        two, heads, slots, d = kv.shape
        b, n = g.ctx_slots.shape
        if g.kv_rows is None:
            g.kv_rows = (torch.arange(two * heads, device=kv.device)[:, None] * slots + g.ctx_slots.view(1, -1)).view(-1)
        both = kv.view(-1, d).index_select(0, g.kv_rows).view(two, heads, b, n, d)
        k, v = both[0].transpose(0, 1), both[1].transpose(0, 1)  # [B, kv_heads, L, D]
    lone = g.uniform == query.shape[2]  # one pass: the query is already [1, H, W, D]
    if lone:
        q = query
    elif g.uniform is not None:  # [1, H, B*W, D] -> [B, H, W, D]: a view
        q = query[0].unflatten(1, (-1, g.uniform)).transpose(0, 1)
    else:
        q = query[0][:, g.q_index].transpose(0, 1)  # [B, heads, Wmax, D]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=g.mask, is_causal=g.causal, scale=scaling,
                                         enable_gqa=q.shape[1] != k.shape[1])
    if lone:
        return out
    if g.uniform is not None:
        return out.transpose(0, 1).flatten(1, 2).unsqueeze(0)
    # [B, H, Wmax, D] -> the real rows, in flat order -> [1, H, rows, D]
    return out.transpose(0, 1).flatten(1, 2)[:, g.q_valid].unsqueeze(0)


def kernel_plan(g: Group, dev) -> tuple:
    """The kernel's arguments after the pool and the query, for a group."""
    starts, windows, frozen = torch.tensor(g.passes, device=dev)  # three contiguous rows
    ctx = g.ctx_slots if g.ctx_slots is not None else _NO_SLOTS
    return ctx, g.ctx_range[0] if g.ctx_range is not None else 0, starts, windows, frozen


def attend(meta: BatchMeta, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           scaling: float) -> torch.Tensor:
    """Write the batch's new K/V rows into `layer`'s pool and attend its queries.
    query: [1, heads, T, head_dim]; key, value: [T, kv_heads, head_dim], the batch's rows in
    order, or None where the caller has written them already (the CPU kernels' rope_store).
    Returns [1, heads, T, head_dim]. Shared by the hook below and the layer stack."""
    kv = meta.kv[layer]  # [2, kv_heads, slots, D]
    if key is not None:
        kv[0].index_copy_(1, meta.slot_mapping, key.transpose(0, 1))
        kv[1].index_copy_(1, meta.slot_mapping, value.transpose(0, 1))
    kernel = meta.kernel
    if kernel is None or all(g.passes is None for g in meta.groups):
        if len(meta.groups) == 1 and meta.groups[0].rows is None:
            return _attend(meta.groups[0], kv, query, scaling)
        out = query.new_empty(query.shape)
    else:
        _, heads, t, d = query.shape
        # token-major, so that the caller's [T, heads * D] view of it needs no copy
        out = query.new_empty((t, heads, d)).transpose(0, 1)[None]
        if query.stride(-1) != 1:
            query = query.contiguous()
    for g in meta.groups:
        if kernel is not None and g.passes is not None:
            if g.plan is None:
                g.plan = kernel_plan(g, query.device)
            kernel(out[0], query[0], kv, *g.plan, scaling)
        else:  # here a group is never the whole batch: that one returned above, or took the kernel
            out[:, :, g.rows] = _attend(g, kv, query, scaling)
    return out


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    # query/key/value: [1, heads, T, head_dim] over the flattened batch.
    out = attend(kwargs["pie_batch"], module.layer_idx, query, key[0].transpose(0, 1), value[0].transpose(0, 1),
                 scaling)
    return out.transpose(1, 2), None


def register() -> None:
    """Register the hook. No mask function is registered on purpose: for an attention
    implementation without one, transformers skips its own mask preparation (the engine
    builds masks per batch), including a per-call scan of position ids for packed sequences."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, paged_attention)

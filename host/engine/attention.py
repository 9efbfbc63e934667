"""The engine's attention hook, registered with transformers' attention interface.

transformers runs its own model code (projections, RoPE, MLP); this function replaces only
the attention core: it writes the batch's new K/V rows into the paged pool and attends each
pass's queries to that pass's frozen rows plus its own window (causally). Rows past a
working set's frozen end from earlier passes are never in the context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

NAME = "pie_paged"


@dataclass
class BatchMeta:
    """Index tensors for one ragged batch, shared by every layer."""

    kv: torch.Tensor  # [layers, 2, slots, kv_heads, head_dim]: the whole pool
    slot_mapping: torch.Tensor  # [T] pool slot of each new row
    ctx_slots: torch.Tensor | None  # [B, Lmax] pool slots of each pass's context (padded)
    ctx_range: tuple[int, int] | None  # one pass whose context is one run of slots: a view, no gather
    q_index: torch.Tensor | None  # [B, Wmax] flat row of each padded query; None when B == 1
    q_valid: torch.Tensor | None  # [B*Wmax] which padded queries are real rows
    mask: torch.Tensor | None  # [B, 1, Wmax, Lmax] bool; None for a single one-row pass


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    meta: BatchMeta = kwargs["pie_batch"]
    layer = module.layer_idx
    pool_k, pool_v = meta.kv[layer, 0], meta.kv[layer, 1]
    # query/key/value: [1, heads, T, head_dim] over the flattened batch.
    pool_k.index_copy_(0, meta.slot_mapping, key[0].transpose(0, 1))
    pool_v.index_copy_(0, meta.slot_mapping, value[0].transpose(0, 1))
    if meta.ctx_range is not None:
        a, b = meta.ctx_range
        k = pool_k[a:b].unsqueeze(0).transpose(1, 2)  # [1, kv_heads, L, D]
        v = pool_v[a:b].unsqueeze(0).transpose(1, 2)
    else:
        shape = (*meta.ctx_slots.shape, *pool_k.shape[1:])  # [B, L, kv_heads, D]
        flat = meta.ctx_slots.view(-1)
        k = pool_k.index_select(0, flat).view(shape).transpose(1, 2)  # [B, kv_heads, L, D]
        v = pool_v.index_select(0, flat).view(shape).transpose(1, 2)
    if meta.q_index is None:
        q = query
    else:
        q = query[0][:, meta.q_index].transpose(0, 1)  # [B, heads, Wmax, D]
    gqa = q.shape[1] != k.shape[1]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=meta.mask, scale=scaling, enable_gqa=gqa)
    if meta.q_index is not None:
        # [B, H, Wmax, D] -> the real rows, in flat order -> [1, H, T, D]
        out = out.transpose(0, 1).flatten(1, 2)[:, meta.q_valid].unsqueeze(0)
    return out.transpose(1, 2), None


def no_mask(*args, **kwargs):
    """Masks are built per batch by the engine; transformers' own mask is not needed."""
    return None


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, paged_attention)
    AttentionMaskInterface.register(NAME, no_mask)

"""The decoder's layer stack run directly over transformers' modules, for the common layer.

A decode pass through transformers' own forward makes some 75 operator calls and a dozen
module calls per layer besides its matrix products, and on the CPU their cost is a large part
of the pass (`python -m bench.profile` splits it). For the Llama layer (Llama, Mistral, Qwen2)
this loop does the same arithmetic with about 20 operators per layer: q/k/v and gate/up come
from one product each (linear.py), RoPE rotates q and k together, and no module machinery
runs between them.
It reads every weight, norm epsilon and rotary table from the loaded transformers model, so it
holds no copy of the model. Each operator computes what transformers' code computes, in the
same order: `tests/test_engine_stack.py` checks the logits are bit-identical on tiny random
models of each supported architecture. Any other architecture runs transformers' forward
with the engine's attention hook (attention.py).

On the CPU in float32, `rows` (csrc/row_ops.cpp) does each layer's elementwise steps in three
calls instead of some thirty operators: the norms and SiLU then round differently from
transformers' (the tests compare within float tolerance). A batch that attends with the paged
kernel runs this loop in C++ (csrc/layer_stack.cpp), call for call and bit for bit: `native`,
None to run this module's loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from . import attention
from . import linear
from .kernels import RowOps
from .linear import PackedLinears

# model_type -> the layer this module runs; each is checked bit-identical by the tests
SUPPORTED = ("llama", "mistral", "qwen2")

Product = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class Layer:
    norm1: torch.Tensor
    qkv: Product  # x -> [q | k | v]
    o: Product
    norm2: torch.Tensor
    gate_up: Product  # x -> [gate | up]
    down: Product
    scaling: float


class LayerStack:
    def __init__(self, decoder: torch.nn.Module, linears: PackedLinears, native: Callable | None = None,
                 rows: RowOps | None = None, layers: list[torch.nn.Module] | None = None,
                 final_norm: torch.nn.Module | None = None, first_layer: int = 0):
        """layers, final_norm: what to run (default: the decoder's layers and norm), over the pool's
        layers from first_layer on (an MTP head's block: its one layer, past the target's)."""
        cfg = decoder.config
        self.decoder = decoder
        self.final_norm = decoder.norm if final_norm is None else final_norm
        self.first_layer = first_layer
        self.linears = linears
        self.rows = rows
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.inter = cfg.intermediate_size
        self.eps = cfg.rms_norm_eps
        self.layers = []
        packed = []  # per layer and product, its packed parts (None: not packed)
        for layer in decoder.layers[:cfg.num_hidden_layers] if layers is None else layers:
            a, m = layer.self_attn, layer.mlp
            products = ([a.q_proj, a.k_proj, a.v_proj], [a.o_proj], [m.gate_proj, m.up_proj], [m.down_proj])
            qkv, o, gate_up, down = (linears.product(ms) for ms in products)
            self.layers.append(Layer(layer.input_layernorm.weight, qkv, o, layer.post_attention_layernorm.weight,
                                     gate_up, down, a.scaling))
            packed.extend(PackedLinears.parts(ms) for ms in products)
        # the C++ loop's arguments: every product packed for the kernels (in one part or several,
        # side by side), or no C++ loop
        parts = [p for ps in packed if ps is not None for p in ps]
        every = all(ps is not None for ps in packed) and all(p.skinny is not None for p in parts)
        self.native = native if every and rows is not None else None
        self._native_args = []
        if self.native is not None:
            norms = [w for ly in self.layers for w in (ly.norm1, ly.norm2)]
            self._native_args = [norms, [len(ps) for ps in packed], [p.skinny for p in parts],
                                 [p.format for p in parts], [p.bias for p in parts], [p.outputs for p in parts]]
        self._scaling = [ly.scaling for ly in self.layers]

    @classmethod
    def of(cls, model: torch.nn.Module, linears: PackedLinears, native: Callable | None = None,
           rows: RowOps | None = None) -> LayerStack | None:
        """The stack for a model whose layers it runs, else None. native: kernels.layer_stack;
        rows: kernels.row_ops (CPU float32), None for torch's operators."""
        cfg = model.config
        if cfg.model_type not in SUPPORTED or cfg.hidden_act != "silu":
            return None
        return cls(model.get_decoder(), linears, native, rows)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # transformers' RMSNorm: normalised in float32, scaled in the model's dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * h.to(x.dtype)

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, meta: attention.BatchMeta,
                 capture: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """input_ids, position_ids: [T]. Returns the last layer's output before and after the
        final norm, [T, hidden] each, and the inputs of the `capture` layers (`run`)."""
        return self.run(self.decoder.embed_tokens(input_ids), position_ids, meta, capture)

    def run(self, x: torch.Tensor, position_ids: torch.Tensor, meta: attention.BatchMeta,
            capture: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """The layers over inputs x [T, hidden] (embedded tokens, or an MTP head's fused input).
        capture: layer indices in [0, layers]; their inputs (the residual stream entering the layer;
        `layers`: the last layer's output before the final norm) come back [T, hidden] each, in order."""
        n_layers = len(self.layers)
        if any(not 0 <= c <= n_layers for c in capture):
            raise ValueError(f"capture layers must be in [0, {n_layers}], not {list(capture)}")
        captured: list = [None] * len(capture)

        def keep(layer: int, h: torch.Tensor) -> None:
            for j, c in enumerate(capture):
                if c == layer:
                    captured[j] = h
        dec, base = self.decoder, self.first_layer
        final = self.final_norm.weight
        kv = meta.kv[base:]
        t, hd, h, kvh = x.shape[0], self.head_dim, self.heads, self.kv_heads
        cos, sin = dec.rotary_emb(x[None], position_ids[None])  # [1, T, head_dim]
        half = hd // 2
        cos = cos[0, :, None, :]
        # rotate_half(x) * sin == roll(x, half) * sin with the first half of sin negated: exactly
        sin = torch.cat([-sin[0, :, None, :half], sin[0, :, None, half:]], -1)
        g = meta.groups[0]
        rows = self.rows
        if (self.native is not None and rows is not None and self.linears.on and not linear.ONEDNN and meta.kernel is not None
                and len(meta.groups) == 1 and g.passes is not None):
            if g.plan is None:
                g.plan = attention.kernel_plan(g, x.device)
            return self.native(x, cos, sin, *self._native_args, final, kv,
                               meta.slot_mapping, *g.plan, self._scaling, self.eps, h, kvh, self.inter, list(capture))
        q_end, k_end = h * hd, (h + kvh) * hd
        if rows is not None:  # the CPU kernels' steps, the C++ loop's calls
            delta = None  # what the last layer adds to x, before the next norm
            for i, ly in enumerate(self.layers):
                x, normed = rows.residual_norm(x, delta, ly.norm1, self.eps)
                keep(i, x)
                q = rows.rope_store(ly.qkv(normed), cos, sin, kv[i], meta.slot_mapping, h, kvh)
                out = attention.attend(meta, base + i, q.transpose(0, 1)[None], None, None, ly.scaling)
                x, normed = rows.residual_norm(x, ly.o(out[0].transpose(0, 1).reshape(t, q_end)), ly.norm2, self.eps)
                delta = ly.down(rows.silu_mul(ly.gate_up(normed), self.inter))
            last, normed = rows.residual_norm(x, delta, final, self.eps)
            keep(n_layers, last)
            return last, normed, captured
        for i, ly in enumerate(self.layers):
            keep(i, x)
            qkv = ly.qkv(self._norm(x, ly.norm1))
            qk = qkv[:, :k_end].view(t, h + kvh, hd)  # q's and k's heads side by side: one rotation
            qk = qk * cos + torch.roll(qk, half, -1) * sin
            q = qk[:, :h].transpose(0, 1)[None]  # [1, heads, T, head_dim]
            out = attention.attend(meta, base + i, q, qk[:, h:], qkv[:, k_end:].view(t, kvh, hd), ly.scaling)
            x = x + ly.o(out[0].transpose(0, 1).reshape(t, q_end))
            gu = ly.gate_up(self._norm(x, ly.norm2))
            x = x + ly.down(F.silu(gu[:, :self.inter]) * gu[:, self.inter:])
        keep(n_layers, x)
        return x, self._norm(x, final), captured

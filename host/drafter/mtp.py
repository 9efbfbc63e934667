"""The MTP draft head (DeepSeek-V3's module) and its on-disk form.

For target position i, with h_i the target's last hidden state before its final norm and t_{i+1}
the token that follows position i:

    x_i   = eh_proj(concat(enorm(embed(t_{i+1})), hnorm(h_i)))   (MiMo: hidden first)
    g_i   = block(x_i)                                            one decoder block of the target's kind
    q_i   = softmax(head(norm(g_i)))                              predicts t_{i+2}

Chained for k > 1 drafts by feeding g_i back as the next step's hidden state. The block has its
own KV rows (one per target position), so its attention sees the head's earlier rows.

Kind `eagle3` (EAGLE-3, arXiv 2503.01840): h_i is not the last layer's output but the hidden
states entering `layers` (default low, middle and high: 2, L/2, L-3), side by side, fused by one
bias-free linear `fc` [H, len(layers) H] before hnorm; chained steps feed g back as MTP does (the
fused features are the target's only). The engine reads those layers' inputs out in place of the
last layer's output for a model whose heads are of this kind (Engine.head_layers).

A head is stored as a folder: `head.safetensors` (the canonical names below, any float dtype) and
`drafter.json` (a HeadSpec). `draft_vocab`, when present, restricts the head's output to those
target token ids (the rows of the target's lm_head, shared): drafting costs a fraction of a full
vocabulary projection, and a draft is always one of those ids.
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

SPEC_FILE, WEIGHTS_FILE = "drafter.json", "head.safetensors"
KIND, EAGLE3 = "mtp", "eagle3"
KINDS = (KIND, EAGLE3)


def default_layers(num_layers: int) -> list[int]:
    """EAGLE-3's feature layers: the inputs of a low, a middle and a high layer (2, L/2, L-3),
    distinct and inside the model (a shallow model gets fewer)."""
    return sorted({min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0)})


@dataclass
class HeadSpec:
    """drafter.json: what a head is and where it came from."""

    name: str
    hidden_size: int
    vocab_size: int  # the target's vocabulary the head's ids index
    hidden_first: bool = False  # MiMo concatenates [hidden, embedding]
    own_head: bool = False  # the head has its own output projection (else the target's lm_head)
    draft_vocab_size: int | None = None  # rows of draft_vocab, when the output is restricted
    kind: str = KIND
    layers: list[int] = field(default_factory=list)  # eagle3: the layers whose inputs the head fuses
    source: str = ""  # where it came from: "mtp:<layout> <path>", a head folder, "trained"
    block: str = ""  # the decoder layer class of the block
    recipe: dict = field(default_factory=dict)  # how a trained head was made, and its validation figures

    def write(self, folder: Path) -> None:
        (Path(folder) / SPEC_FILE).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @staticmethod
    def read(folder: Path) -> "HeadSpec":
        data = json.loads((Path(folder) / SPEC_FILE).read_text())
        return HeadSpec(**{k: data[k] for k in HeadSpec.__dataclass_fields__ if k in data})


def decoder_layer_class(target) -> type:
    """The class of the target's decoder layers (the block is one more of them)."""
    layers = getattr(target.get_decoder(), "layers", None)
    if not layers:
        raise TypeError(f"{type(target).__name__} has no `layers` of decoder blocks")
    return type(layers[0])


def _norm_like(target, hidden_size: int, eps: float) -> nn.Module:
    """A norm of the target's own kind (RMSNorm variants differ: (1 + w) scaling, dtype handling)."""
    return type(target.get_decoder().norm)(hidden_size, eps=eps)


class MtpHead(nn.Module):
    """One MTP module over a target. Parameters (canonical names in head.safetensors):
    enorm.weight, hnorm.weight, eh_proj.weight [H, 2H], block.* (the decoder layer's own names),
    norm.weight, head.weight [V, H] (only with own_head), draft_vocab (int64, optional),
    fc.weight [H, len(layers) H] (kind eagle3: `layers` given)."""

    def __init__(self, target, *, hidden_first: bool = False, own_head: bool = False,
                 draft_vocab: torch.Tensor | None = None, layer_idx: int | None = None,
                 layers: list[int] | None = None):
        super().__init__()
        cfg = copy.copy(target.config)  # the block's attention implementation is set per use
        H = cfg.hidden_size
        eps = getattr(cfg, "rms_norm_eps", 1e-6)
        self.config = cfg
        idx = cfg.num_hidden_layers if layer_idx is None else layer_idx
        types = getattr(cfg, "layer_types", None)
        if isinstance(types, (list, tuple)) and idx >= len(types):
            # configs with per-layer types (Qwen2/3...) index them by layer_idx: the block, one layer
            # past the target's, is a full-attention layer (the engine runs only those)
            cfg.layer_types = list(types) + ["full_attention"] * (idx + 1 - len(types))
        self.hidden_first = hidden_first
        self.eps = eps
        self.layers = tuple(int(x) for x in layers or ())
        L = cfg.num_hidden_layers
        if self.layers and (len(set(self.layers)) != len(self.layers) or not all(0 <= x <= L for x in self.layers)):
            raise ValueError(f"an eagle3 head's layers are distinct, in 0..{L}: not {list(self.layers)}")
        self.fc = nn.Linear(len(self.layers) * H, H, bias=False) if self.layers else None
        self.enorm = _norm_like(target, H, eps)
        self.hnorm = _norm_like(target, H, eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.block = decoder_layer_class(target)(cfg, cfg.num_hidden_layers if layer_idx is None else layer_idx)
        self.norm = _norm_like(target, H, eps)
        V = target.get_output_embeddings().out_features
        self.head = nn.Linear(H, V, bias=False) if own_head else None
        if draft_vocab is not None:
            draft_vocab = torch.as_tensor(draft_vocab, dtype=torch.int64)
            if draft_vocab.dim() != 1 or not len(draft_vocab) or draft_vocab.min() < 0 or draft_vocab.max() >= V:
                raise ValueError(f"draft_vocab must be a non-empty list of ids in [0, {V})")
        self.register_buffer("draft_vocab", draft_vocab, persistent=True)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def kind(self) -> str:
        return EAGLE3 if self.layers else KIND

    def set_attention(self, implementation: str) -> None:
        """Which attention the block runs: the engine's paged hook, or sdpa/eager for training."""
        self.config._attn_implementation = implementation
        self.block.self_attn.config = self.config

    def fuse(self, embeds: torch.Tensor, hidden: torch.Tensor, norm=None, target: bool = True) -> torch.Tensor:
        """eh_proj's input and product; norm(x, module), if given, computes enorm's and hnorm's
        RMSNorm in place of the modules (the engine's own kernel). target: `hidden` is the
        target's readout (an eagle3 head fuses its layers with fc first), not the head's own g."""
        if self.fc is not None and target:
            hidden = self.fc(hidden)
        if norm is None:
            e, h = self.enorm(embeds), self.hnorm(hidden)
        else:
            e, h = norm(embeds, self.enorm), norm(hidden, self.hnorm)
        return self.eh_proj(torch.cat([h, e] if self.hidden_first else [e, h], dim=-1))

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, position_embeddings, target: bool = True,
                **block_kwargs) -> torch.Tensor:
        """embeds: [B, T, H]; hidden: [B, T, H] (eagle3 and target: [B, T, len(layers) H]) -> g
        [B, T, H], the block's output before the norm (fed back as the next chained step's hidden state)."""
        out = self.block(self.fuse(embeds, hidden, target=target), position_embeddings=position_embeddings,
                         **block_kwargs)
        return out[0] if isinstance(out, tuple) else out

    def output_weight(self, target_head_weight: torch.Tensor) -> torch.Tensor:
        """[Vd, H]: the rows the head projects onto (all V, or draft_vocab's)."""
        w = self.head.weight if self.head is not None else target_head_weight
        return w if self.draft_vocab is None else w.index_select(0, self.draft_vocab.to(w.device))

    def logits(self, g: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Logits over the output rows (weight from output_weight); index i is draft_vocab[i] when restricted."""
        return torch.nn.functional.linear(self.norm(g), weight)

    # ---- the on-disk form ---------------------------------------------------------
    def spec(self, name: str, source: str = "", recipe: dict | None = None) -> HeadSpec:
        return HeadSpec(name=name, hidden_size=self.config.hidden_size, vocab_size=self.config.vocab_size,
                        hidden_first=self.hidden_first, own_head=self.head is not None,
                        draft_vocab_size=None if self.draft_vocab is None else len(self.draft_vocab),
                        kind=self.kind, layers=list(self.layers),
                        source=source, block=type(self.block).__name__, recipe=dict(recipe or {}))

    def save(self, folder: Path, spec: HeadSpec, dtype: torch.dtype | None = None) -> None:
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        state = {k: (v if dtype is None or not v.is_floating_point() else v.to(dtype)).contiguous()
                 for k, v in self.state_dict().items() if v is not None}
        save_file(state, str(folder / WEIGHTS_FILE), metadata={"format": "pt", "kind": self.kind})
        spec.write(folder)


def check_compatible(spec: HeadSpec, target) -> None:
    """Raise ValueError when a head cannot run on this target (hidden size, vocabulary)."""
    cfg = target.config
    V = target.get_output_embeddings().out_features
    if spec.kind not in KINDS:
        raise ValueError(f"drafter {spec.name!r} is of kind {spec.kind!r}; the kinds are {', '.join(KINDS)}")
    if (spec.kind == EAGLE3) != bool(spec.layers):
        raise ValueError(f"drafter {spec.name!r}: an {EAGLE3} head names its feature layers, an {KIND} head none")
    if any(not 0 <= x <= cfg.num_hidden_layers for x in spec.layers):
        raise ValueError(f"drafter {spec.name!r} fuses layers {spec.layers}; the model has {cfg.num_hidden_layers}")
    if spec.hidden_size != cfg.hidden_size:
        raise ValueError(f"drafter {spec.name!r} has hidden size {spec.hidden_size}, the model {cfg.hidden_size}")
    if spec.vocab_size != V:
        raise ValueError(f"drafter {spec.name!r} has a vocabulary of {spec.vocab_size} tokens, the model {V}")


def load_head(folder: Path, target, dtype: torch.dtype | None = None, device=None) -> tuple[MtpHead, HeadSpec]:
    """Read a head folder for `target`; weights are converted to `dtype` (default: the target's)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    spec = HeadSpec.read(folder)
    check_compatible(spec, target)
    state = load_file(str(folder / WEIGHTS_FILE))
    head = MtpHead(target, hidden_first=spec.hidden_first, own_head=spec.own_head,
                   draft_vocab=state.get("draft_vocab"), layers=spec.layers)
    missing, unexpected = head.load_state_dict(state, strict=False)
    missing = [k for k in missing if k != "draft_vocab"]
    if missing or unexpected:
        raise ValueError(f"drafter {spec.name!r} at {folder}: missing {missing[:4]}, unexpected {unexpected[:4]}")
    p = next(target.parameters())
    head.to(device=device or p.device, dtype=dtype or p.dtype)
    if head.draft_vocab is not None:
        head.draft_vocab = head.draft_vocab.to(torch.int64)
    return head.eval(), spec

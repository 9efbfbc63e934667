"""MTP layers that ship inside a Hugging Face checkpoint, converted to an MtpHead (host/drafter/mtp.py).

transformers drops these weights when it loads the model, so they are read here straight from the
checkpoint's safetensors files (sharded or not). Three layouts, named as vLLM's loaders read them
(vllm/model_executor/models/deepseek_mtp.py, qwen3_next_mtp.py / qwen3_5_mtp.py, mimo_mtp.py):

  deepseek   (DeepSeek-V3, GLM-4.5; config `num_nextn_predict_layers`): the MTP layers follow the
             decoder layers, `model.layers.{N}.` with N = num_hidden_layers for the first:
             enorm, hnorm, eh_proj, shared_head.norm, shared_head.head, embed_tokens (the shared
             embedding: ignored), and the block's own names (self_attn.*, mlp.*, input_layernorm, ...).
             concat [embedding, hidden].
  qwen3next  (Qwen3-Next, Qwen3.5; config `num_nextn_predict_layers` / `mtp_num_hidden_layers`):
             `mtp.fc` (eh_proj), `mtp.pre_fc_norm_embedding` (enorm), `mtp.pre_fc_norm_hidden` (hnorm),
             `mtp.layers.0.*` (the block), `mtp.norm`. concat [embedding, hidden].
  mimo       (Xiaomi MiMo): `model.mtp_layers.{i}.` token_layernorm (enorm), hidden_layernorm (hnorm),
             input_proj (eh_proj), final_layernorm (norm), and the block's own names.
             concat [hidden, embedding].

Only the first MTP layer is attached (depth 1: the head is chained by feeding its output back as
the next step's hidden state, as MtpHead documents); later layers are ignored.

`check_target_supported` refuses, at import, targets the engine cannot run (host/engine/attention.py:
standard GQA attention with one head dim for K and V, full attention in every layer).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from ..errors import ImportFailed, InvalidArgument
from .mtp import HeadSpec, MtpHead

INDEX_FILE = "model.safetensors.index.json"
ENGINE_NEEDS = ("the engine runs decoders with standard (grouped-query) attention, one head dim for K and V, "
                "and full attention in every layer")

# layout -> (canonical name -> checkpoint name relative to the layer prefix); the rest under the
# prefix is the block (its decoder layer's own names)
_NAMES = {
    "deepseek": {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
                 "norm.weight": "shared_head.norm.weight", "head.weight": "shared_head.head.weight"},
    "qwen3next": {"enorm.weight": "pre_fc_norm_embedding.weight", "hnorm.weight": "pre_fc_norm_hidden.weight",
                  "eh_proj.weight": "fc.weight", "norm.weight": "norm.weight"},
    "mimo": {"enorm.weight": "token_layernorm.weight", "hnorm.weight": "hidden_layernorm.weight",
             "eh_proj.weight": "input_proj.weight", "norm.weight": "final_layernorm.weight"},
}
_IGNORED = {"deepseek": ("embed_tokens.",)}  # the shared embedding, repeated in each MTP layer
HIDDEN_FIRST = {"deepseek": False, "qwen3next": False, "mimo": True}


# ---- reading a checkpoint folder ------------------------------------------------------------
class Checkpoint:
    """The tensors of a Hugging Face checkpoint folder, by name, read lazily with safe_open."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.config = read_config(self.folder)
        index = self.folder / INDEX_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            self.files = {k: self.folder / f for k, f in weight_map.items()}
        else:
            from safetensors import safe_open

            self.files = {}
            for f in sorted(self.folder.glob("*.safetensors")):
                with safe_open(str(f), framework="pt") as st:
                    self.files.update((k, f) for k in st.keys())

    def keys(self):
        return self.files.keys()

    def get(self, key: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self.files[key]), framework="pt") as st:
            return st.get_tensor(key)

    def shape(self, key: str) -> list[int]:
        from safetensors import safe_open

        with safe_open(str(self.files[key]), framework="pt") as st:
            return list(st.get_slice(key).get_shape())


def read_config(folder: Path) -> dict:
    try:
        return json.loads((Path(folder) / "config.json").read_text())
    except FileNotFoundError:
        raise ImportFailed(f"{folder} has no config.json: not a Hugging Face model folder") from None
    except ValueError as e:
        raise ImportFailed(f"{folder}/config.json is not valid JSON: {e}") from None


def _text_config(config: dict) -> dict:
    return config.get("text_config") or config


def find_mtp(ckpt: Checkpoint) -> tuple[str, str, int] | None:
    """(layout, key prefix of the first MTP layer, number of MTP layers), or None when the
    checkpoint has none. Detected from the keys (the config fields only corroborate)."""
    keys = ckpt.keys()
    if "mtp.fc.weight" in keys:
        n = len({m.group(1) for k in keys if (m := re.match(r"mtp\.layers\.(\d+)\.", k))})
        return "qwen3next", "mtp.", max(n, 1)
    mimo = sorted({int(m.group(1)) for k in keys
                   if (m := re.match(r"model\.mtp_layers\.(\d+)\.input_proj\.weight$", k))})
    if mimo:
        return "mimo", f"model.mtp_layers.{mimo[0]}.", len(mimo)
    deep = sorted({int(m.group(1)) for k in keys if (m := re.match(r"model\.layers\.(\d+)\.eh_proj\.weight$", k))})
    if deep:
        cfg = _text_config(ckpt.config)
        first = cfg.get("num_hidden_layers", deep[0])
        first = first if first in deep else deep[0]
        return "deepseek", f"model.layers.{first}.", len(deep)
    return None


def has_mtp_layers(folder: Path) -> bool:
    return find_mtp(Checkpoint(folder)) is not None


def no_mtp_error(folder: Path) -> InvalidArgument:
    ckpt_cfg = _text_config(read_config(folder))
    declared = ckpt_cfg.get("num_nextn_predict_layers") or ckpt_cfg.get("mtp_num_hidden_layers")
    why = (f" (its config declares {declared}, but no MTP weights are in the safetensors files)" if declared else "")
    return InvalidArgument(f"--drafter mtp: {folder} has no MTP layers{why}; give a head folder or a trained "
                           f"drafter's name instead")


# ---- conversion ---------------------------------------------------------------------------
def read_mtp_head(folder: Path, target, name: str = "mtp") -> tuple[MtpHead, HeadSpec]:
    """The first MTP layer of the checkpoint at `folder` as an MtpHead over `target` (a loaded
    transformers causal LM of the same model), in the target's dtype and device."""
    folder = Path(folder)
    ckpt = Checkpoint(folder)
    found = find_mtp(ckpt)
    if found is None:
        raise no_mtp_error(folder)
    layout, prefix, _ = found
    names = _NAMES[layout]
    ignored = _IGNORED.get(layout, ())
    own = set(names.values())
    block_prefix = prefix + "layers.0." if layout == "qwen3next" else prefix
    block_keys = {}
    for k in ckpt.keys():
        if not k.startswith(block_prefix) or "rotary_emb.inv_freq" in k:
            continue
        rel = k[len(block_prefix):]
        if layout != "qwen3next" and (rel in own or rel.startswith(ignored)):
            continue
        block_keys["block." + rel] = k
    missing_top = [prefix + names[c] for c in names if c != "head.weight" and prefix + names[c] not in ckpt.files]
    if missing_top:
        raise ImportFailed(f"the MTP layer at {prefix}* in {folder} ({layout} layout) lacks {missing_top}")

    own_head = False
    p = next(target.parameters())
    head_key = prefix + names.get("head.weight", "\0")
    if head_key in ckpt.files:
        target_w = target.get_output_embeddings().weight
        w = ckpt.get(head_key)
        own_head = not (w.shape == target_w.shape and torch.equal(w.to(device=target_w.device, dtype=target_w.dtype),
                                                                  target_w))
    # built without storage (a mixture-of-experts block holds billions of parameters: no random
    # init in float32), then given the checkpoint's tensors
    with torch.device("meta"):
        head = MtpHead(target, hidden_first=HIDDEN_FIRST[layout], own_head=own_head)

    expected = head.state_dict()
    fused = _fuse_experts(expected, block_keys)
    want_block = sorted(k for k in expected if k.startswith("block."))
    missing = [k[len("block."):] for k in want_block if k not in block_keys and k not in fused]
    unexpected = [block_keys[k] for k in sorted(block_keys) if k not in expected]
    if missing or unexpected:
        raise ImportFailed(
            f"the MTP block at {block_prefix}* in {folder} does not match {type(head.block).__name__}, the model's "
            f"decoder layer (a different attention or MLP, e.g. MLA or mixture-of-experts, or quantized weights): "
            f"checkpoint keys it lacks: {missing[:4] or 'none'}; keys it does not know: {unexpected[:4] or 'none'}")

    sources = {c: prefix + r for c, r in names.items() if c != "head.weight" or own_head} | block_keys
    state = {}
    for canon, key in [*sources.items(), *fused.items()]:
        if isinstance(key, str):
            t = ckpt.get(key)
        else:  # one expert per row: [E, ...] from the per-expert tensors (gate and up concatenated)
            t = torch.stack([torch.cat([ckpt.get(k) for k in group], 0) for group in key])
            key = f"{key[0][0]} .. {key[-1][-1]}"
        if tuple(t.shape) != tuple(expected[canon].shape):
            raise ImportFailed(f"the MTP weight {key} in {folder} has shape {list(t.shape)}, the model's "
                               f"{canon} needs {list(expected[canon].shape)}")
        if not t.is_floating_point():
            raise ImportFailed(f"the MTP weight {key} in {folder} is {t.dtype}, not a float tensor (quantized?)")
        state[canon] = t.to(device=p.device, dtype=p.dtype)
    head.load_state_dict(state, strict=False, assign=True)  # every key was checked above; draft_vocab stays None
    if any(t.is_meta for t in head.buffers()):  # a non-persistent buffer the block computes itself
        head = MtpHead(target, hidden_first=HIDDEN_FIRST[layout], own_head=own_head)
        head.load_state_dict(state, strict=False)
        head.to(device=p.device, dtype=p.dtype)
    spec = head.spec(name, source=f"mtp:{layout} {folder.resolve()}")
    return head.eval(), spec


def _fuse_experts(expected: dict, block_keys: dict[str, str]) -> dict[str, list[list[str]]]:
    """Mixture-of-experts blocks: transformers keeps the experts as 3-D parameters
    (`<experts>.gate_up_proj` [E, 2I, H]: each expert's gate_proj then up_proj rows;
    `<experts>.down_proj` [E, H, I]), checkpoints one tensor per expert (`<experts>.{e}.gate_proj.weight`,
    `.up_proj.weight`, `.down_proj.weight`). Returns canonical name -> per-expert checkpoint keys,
    and takes those keys out of block_keys."""
    out = {}
    for name, t in expected.items():
        base, _, leaf = name.rpartition(".")
        parts = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}.get(leaf)
        if not name.startswith("block.") or parts is None or t.dim() != 3 or name in block_keys:
            continue
        groups = [[f"{base}.{e}.{part}.weight" for part in parts] for e in range(t.shape[0])]
        if all(k in block_keys for g in groups for k in g):
            out[name] = [[block_keys.pop(k) for k in g] for g in groups]
    return out


# ---- targets the engine can run ---------------------------------------------------------------
def _get(cfg, key, default=None):
    return cfg.get(key, default) if isinstance(cfg, dict) else getattr(cfg, key, default)


def target_problem(config) -> str | None:
    """Why the engine cannot run a model of this config (a config.json dict or a transformers
    config), or None. Checks the config and, for multimodal wrappers, its text config."""
    model_type = _get(config, "model_type", "") or ""
    archs = _get(config, "architectures") or []
    if model_type == "mimo" or any(a.startswith("MiMo") for a in archs):
        return ("MiMo (MiMoForCausalLM) is not in transformers (it ships as remote code); "
                "pie imports only architectures transformers has")
    text = _get(config, "text_config")
    for cfg in (config, text) if text is not None else (config,):
        if _get(cfg, "kv_lora_rank") is not None or _get(cfg, "q_lora_rank") is not None:
            qk = (_get(cfg, "qk_nope_head_dim") or 0) + (_get(cfg, "qk_rope_head_dim") or 0)
            v = _get(cfg, "v_head_dim")
            dims = f": K head dim {qk}, V head dim {v}" if qk and v else ""
            return f"it uses multi-head latent attention (MLA), whose K and V head dims differ{dims}"
        qk = (_get(cfg, "qk_nope_head_dim") or 0) + (_get(cfg, "qk_rope_head_dim") or 0)
        v = _get(cfg, "v_head_dim")
        if qk and v and qk != v:
            return f"its K and V head dims differ ({qk} and {v})"
        layer_types = _get(cfg, "layer_types") or []
        other = sorted({t for t in layer_types if t != "full_attention"})
        if other:
            what = {"linear_attention": "linear-attention (recurrent state) layers",
                    "sliding_attention": "sliding-window attention layers"}
            return "it has " + " and ".join(what.get(t, f"{t!r} layers") for t in other)
        for key in ("layers_block_type", "hybrid_override_pattern", "attn_layer_indices", "linear_attn_config"):
            if _get(cfg, key):
                return f"it is a hybrid model ({key} in its config): not every layer is attention"
        interval = _get(cfg, "full_attention_interval")
        if interval and interval > 1:
            return f"only every {interval}th layer has full attention (the others are linear attention)"
    if not isinstance(config, dict):
        cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
        if _get(cfg, "num_key_value_heads") is None or _get(cfg, "num_attention_heads") is None:
            return "its config gives no num_attention_heads / num_key_value_heads (not a GQA decoder)"
    return None


def check_target_supported(config, what: str | None = None) -> None:
    """Raise ImportFailed naming why the engine cannot run a model of this config."""
    problem = target_problem(config)
    if problem:
        archs = _get(config, "architectures") or []
        what = what or (archs[0] if archs else _get(config, "model_type", "") or "this model")
        raise ImportFailed(f"{what} cannot run on pie's engine: {problem}; {ENGINE_NEEDS}")


def check_target_model(model) -> None:
    """The loaded model's side of check_target_supported: every decoder layer has self-attention."""
    check_target_supported(model.config, type(model).__name__)
    layers = getattr(model.get_decoder(), "layers", None)
    if not layers or not all(hasattr(layer, "self_attn") for layer in layers):
        raise ImportFailed(f"{type(model).__name__} cannot run on pie's engine: not every decoder layer has "
                           f"self-attention; {ENGINE_NEEDS}")

"""MTP layers inside a checkpoint (host/drafter/layouts.py): each layout converts to an MtpHead whose
outputs match a plain-PyTorch reference of the MTP formula over the checkpoint's raw tensors;
checkpoints without MTP layers, blocks of another kind, and targets the engine cannot run are
clear errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from host.drafter import layouts
from host.drafter.mtp import load_head
from host.errors import ImportFailed, InvalidArgument

V, H, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN = 64, 32, 2, 4, 2, 8, 48
EPS, THETA = 1e-6, 10000.0


def tiny_target(kind: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(vocab_size=V, hidden_size=H, intermediate_size=FFN, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, rms_norm_eps=EPS,
                  max_position_embeddings=64, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": THETA})
    torch.manual_seed(0)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(head_dim=HEAD_DIM, **common))
    elif kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=HEAD_DIM, **common))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common))  # head_dim = H / HEADS = 8; q/k/v with bias
    return model.eval()


def rand_like(name: str, t: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    noise = torch.randn(t.shape, generator=g)
    return 1 + 0.1 * noise if name.endswith("norm.weight") else 0.2 * noise


def mtp_tensors(target, layout: str, g: torch.Generator, own_head: bool | None = None) -> dict[str, torch.Tensor]:
    """The first MTP layer in `layout`'s naming, random (the block: one more layer of the target's kind)."""
    block = {k: rand_like(k, v, g) for k, v in target.model.layers[0].state_dict().items()}
    top = {"enorm": rand_like("norm.weight", torch.empty(H), g), "hnorm": rand_like("norm.weight", torch.empty(H), g),
           "eh_proj": rand_like("proj", torch.empty(H, 2 * H), g), "norm": rand_like("norm.weight", torch.empty(H), g)}
    if layout == "deepseek":
        p = f"model.layers.{LAYERS}."
        out = {p + "enorm.weight": top["enorm"], p + "hnorm.weight": top["hnorm"], p + "eh_proj.weight": top["eh_proj"],
               p + "shared_head.norm.weight": top["norm"],
               p + "embed_tokens.weight": target.model.embed_tokens.weight.detach().clone()}
        if own_head is not None:
            w = target.lm_head.weight.detach().clone()
            out[p + "shared_head.head.weight"] = rand_like("head", w, g) if own_head else w
    elif layout == "qwen3next":
        p = "mtp.layers.0."
        out = {"mtp.pre_fc_norm_embedding.weight": top["enorm"], "mtp.pre_fc_norm_hidden.weight": top["hnorm"],
               "mtp.fc.weight": top["eh_proj"], "mtp.norm.weight": top["norm"]}
    else:
        p = "model.mtp_layers.0."
        out = {p + "token_layernorm.weight": top["enorm"], p + "hidden_layernorm.weight": top["hnorm"],
               p + "input_proj.weight": top["eh_proj"], p + "final_layernorm.weight": top["norm"]}
    out |= {p + k: v for k, v in block.items()}
    return out


def write_checkpoint(folder, target, extra: dict, config_extra: dict | None = None, shards: int = 1):
    """A Hugging Face checkpoint folder: config.json and the target's weights plus `extra`."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = target.config.to_dict() | {"architectures": [type(target).__name__]} | (config_extra or {})
    (folder / "config.json").write_text(json.dumps(cfg))
    state = {k: v.detach().clone().contiguous() for k, v in target.state_dict().items()} | extra
    names = sorted(state)
    if shards == 1:
        save_file(state, str(folder / "model.safetensors"))
        return state
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: state[k] for k in part}, str(folder / fname))
        weight_map |= {k: fname for k in part}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return state


# ---- the reference: the MTP formula in plain PyTorch over the raw tensors ---------------------
def rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def rope(x, pos):  # x [heads, T, d]; rotate-half convention
    d = x.shape[-1]
    inv = 1.0 / THETA ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = pos[:, None].float() * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    rot = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos + rot * sin


def ref_block(x, p: dict, pre: str):  # x [T, H]
    T = x.shape[0]

    def lin(h, name):
        y = h @ p[pre + name + ".weight"].T
        b = p.get(pre + name + ".bias")
        return y if b is None else y + b

    h = rms(x, p[pre + "input_layernorm.weight"])
    q = lin(h, "self_attn.q_proj").view(T, HEADS, HEAD_DIM).transpose(0, 1)
    k = lin(h, "self_attn.k_proj").view(T, KV_HEADS, HEAD_DIM).transpose(0, 1)
    v = lin(h, "self_attn.v_proj").view(T, KV_HEADS, HEAD_DIM).transpose(0, 1)
    if pre + "self_attn.q_norm.weight" in p:  # Qwen3: per-head RMSNorm of q and k before RoPE
        q, k = rms(q, p[pre + "self_attn.q_norm.weight"]), rms(k, p[pre + "self_attn.k_norm.weight"])
    pos = torch.arange(T)
    q, k = rope(q, pos), rope(k, pos)
    rep = HEADS // KV_HEADS
    k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
    scores = q @ k.transpose(1, 2) / HEAD_DIM ** 0.5
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    att = (scores.softmax(-1) @ v).transpose(0, 1).reshape(T, HEADS * HEAD_DIM)
    x = x + lin(att, "self_attn.o_proj")
    h = rms(x, p[pre + "post_attention_layernorm.weight"])
    return x + lin(torch.nn.functional.silu(lin(h, "mlp.gate_proj")) * lin(h, "mlp.up_proj"), "mlp.down_proj")


REF_NAMES = {  # layout -> (enorm, hnorm, eh_proj, norm, head or None, block prefix)
    "deepseek": ("{p}enorm.weight", "{p}hnorm.weight", "{p}eh_proj.weight", "{p}shared_head.norm.weight",
                 "{p}shared_head.head.weight", "{p}"),
    "qwen3next": ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.fc.weight",
                  "mtp.norm.weight", None, "mtp.layers.0."),
    "mimo": ("{p}token_layernorm.weight", "{p}hidden_layernorm.weight", "{p}input_proj.weight",
             "{p}final_layernorm.weight", None, "{p}"),
}
PREFIX = {"deepseek": f"model.layers.{LAYERS}.", "qwen3next": "mtp.", "mimo": "model.mtp_layers.0."}


def ref_mtp(p: dict, layout: str, embeds, hidden, hidden_first: bool):
    en, hn, proj, norm, head, pre = (n.format(p=PREFIX[layout]) if n else None for n in REF_NAMES[layout])
    e, h = rms(embeds, p[en]), rms(hidden, p[hn])
    x = torch.cat([h, e] if hidden_first else [e, h], -1) @ p[proj].T
    g = ref_block(x, p, pre)
    w = p[head] if head and head in p else p["lm_head.weight"]
    return g, rms(g, p[norm]) @ w.T


def run_head(head, target, embeds, hidden):
    head.set_attention("sdpa")
    pos = torch.arange(embeds.shape[1])[None]
    with torch.no_grad():
        g = head(embeds, hidden, target.model.rotary_emb(embeds, pos))
        return g, head.logits(g, head.output_weight(target.lm_head.weight))


CASES = [  # (layout, target kind, shards, deepseek shared_head.head: None absent / False the lm_head / True its own)
    ("deepseek", "llama", 2, False),
    ("deepseek", "llama", 1, True),
    ("deepseek", "qwen3", 1, None),
    ("qwen3next", "qwen3", 2, None),
    ("qwen3next", "llama", 1, None),
    ("mimo", "qwen2", 1, None),
    ("mimo", "llama", 3, None),
]


@pytest.mark.parametrize("layout, kind, shards, own", CASES)
def test_layout_matches_reference(tmp_path, layout, kind, shards, own):
    target = tiny_target(kind)
    g = torch.Generator().manual_seed(1)
    extra = mtp_tensors(target, layout, g, own_head=own)
    cfg_extra = {"num_nextn_predict_layers": 1} if layout != "mimo" else {}
    state = write_checkpoint(tmp_path / "ckpt", target, extra, cfg_extra, shards=shards)

    head, spec = layouts.read_mtp_head(tmp_path / "ckpt", target)
    assert spec.source == f"mtp:{layout} {(tmp_path / 'ckpt').resolve()}" and spec.name == "mtp"
    assert spec.hidden_first == (layout == "mimo") and spec.own_head == bool(own)
    assert spec.block == type(target.model.layers[0]).__name__

    T = 6
    ids = torch.randint(0, V, (1, T), generator=g)
    embeds = target.model.embed_tokens(ids).detach()
    hidden = torch.randn(1, T, H, generator=g)
    got_g, got_logits = run_head(head, target, embeds, hidden)
    ref_g, ref_logits = ref_mtp(state, layout, embeds[0], hidden[0], hidden_first=layout == "mimo")
    torch.testing.assert_close(got_g[0], ref_g, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_logits[0], ref_logits, atol=1e-4, rtol=1e-4)
    # the concat order matters: the reference with the other order is far off
    swapped_g, _ = ref_mtp(state, layout, embeds[0], hidden[0], hidden_first=layout != "mimo")
    assert (swapped_g - got_g[0]).abs().max() > 1e-2

    # the converted head round-trips through its folder
    head.save(tmp_path / "head", spec)
    again, spec2 = load_head(tmp_path / "head", target)
    assert spec2 == spec
    torch.testing.assert_close(run_head(again, target, embeds, hidden)[1], got_logits, atol=0, rtol=0)


def test_no_mtp_layers_is_a_clear_error(tmp_path):
    target = tiny_target("llama")
    write_checkpoint(tmp_path / "plain", target, {})
    assert not layouts.has_mtp_layers(tmp_path / "plain")
    with pytest.raises(InvalidArgument, match="has no MTP layers"):
        layouts.read_mtp_head(tmp_path / "plain", target)
    # a config that declares MTP layers whose weights were stripped says so
    write_checkpoint(tmp_path / "stripped", target, {}, {"num_nextn_predict_layers": 1})
    with pytest.raises(InvalidArgument, match="has no MTP layers .*declares 1"):
        layouts.read_mtp_head(tmp_path / "stripped", target)


@pytest.mark.parametrize("block_kind, first_key", [
    ("mla", "self_attn.kv_a_proj_with_mqa.weight"),
    ("moe", "mlp.experts.0.down_proj.weight"),
])
def test_block_of_another_kind_names_the_keys(tmp_path, block_kind, first_key):
    target = tiny_target("llama")
    extra = mtp_tensors(target, "deepseek", torch.Generator().manual_seed(2), own_head=False)
    p = f"model.layers.{LAYERS}."
    if block_kind == "mla":
        for k in ("q_proj", "k_proj", "v_proj"):
            del extra[p + f"self_attn.{k}.weight"]
        extra[p + "self_attn.kv_a_proj_with_mqa.weight"] = torch.zeros(16, H)
        extra[p + "self_attn.kv_b_proj.weight"] = torch.zeros(64, 8)
    else:
        for k in ("gate_proj", "up_proj", "down_proj"):
            del extra[p + f"mlp.{k}.weight"]
            extra[p + f"mlp.experts.0.{k}.weight"] = torch.zeros(4, 4)
        extra[p + "mlp.gate.weight"] = torch.zeros(4, H)
    write_checkpoint(tmp_path / "ckpt", target, extra, {"num_nextn_predict_layers": 1})
    with pytest.raises(ImportFailed, match="does not match LlamaDecoderLayer") as e:
        layouts.read_mtp_head(tmp_path / "ckpt", target)
    assert first_key in str(e.value) and "lacks" in str(e.value)


def test_wrong_shape_is_a_clear_error(tmp_path):
    target = tiny_target("llama")
    extra = mtp_tensors(target, "qwen3next", torch.Generator().manual_seed(3))
    extra["mtp.fc.weight"] = torch.zeros(H, H)  # not [H, 2H]
    write_checkpoint(tmp_path / "ckpt", target, extra)
    with pytest.raises(ImportFailed, match=r"mtp.fc.weight .* shape \[32, 32\]"):
        layouts.read_mtp_head(tmp_path / "ckpt", target)


def _tiny_config(name: str):
    import transformers

    small = dict(vocab_size=V, hidden_size=H, intermediate_size=FFN, num_hidden_layers=LAYERS,
                 num_attention_heads=HEADS, num_key_value_heads=KV_HEADS)
    if name == "deepseek_v3":
        return transformers.DeepseekV3Config(**small, moe_intermediate_size=16, n_routed_experts=4,
                                             num_experts_per_tok=2,
                                             kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4,
                                             v_head_dim=8, first_k_dense_replace=1, num_nextn_predict_layers=1,
                                             architectures=["DeepseekV3ForCausalLM"])
    if name == "qwen3_next":
        return transformers.Qwen3NextConfig(**small, head_dim=HEAD_DIM, architectures=["Qwen3NextForCausalLM"])
    if name == "mimo":
        return {**transformers.Qwen2Config(**small).to_dict(), "model_type": "mimo",
                "architectures": ["MiMoForCausalLM"], "num_nextn_predict_layers": 1}
    cls = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "mistral": "MistralConfig",
           "glm4_moe": "Glm4MoeConfig", "gemma2": "Gemma2Config"}[name]
    return getattr(transformers, cls)(**small)


@pytest.mark.parametrize("name, match", [
    ("deepseek_v3", "multi-head latent attention"),
    ("qwen3_next", "linear-attention"),
    ("mimo", "MiMo .*not in transformers"),
    ("gemma2", "sliding-window"),
])
def test_unsupported_targets_are_refused_at_import(tmp_path, monkeypatch, name, match):
    from host import store

    cfg = _tiny_config(name)
    data = cfg if isinstance(cfg, dict) else cfg.to_dict()
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(data))
    with pytest.raises(ImportFailed, match=f"cannot run on pie's engine: .*{match}"):
        layouts.check_target_supported(data)
    if not isinstance(cfg, dict):
        with pytest.raises(ImportFailed, match=match):
            layouts.check_target_supported(cfg)
    # the store refuses it before loading any weights (there are none in the folder)
    monkeypatch.setenv("PIE_HOME", str(tmp_path / "pie"))
    with pytest.raises(ImportFailed, match=match):
        store.import_model(str(folder), progress=False)
    assert not (tmp_path / "pie" / "models").exists() or not any((tmp_path / "pie" / "models").iterdir())


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "mistral", "glm4_moe"])
def test_standard_attention_targets_pass(name):
    cfg = _tiny_config(name)
    assert layouts.target_problem(cfg) is None
    assert layouts.target_problem(cfg.to_dict()) is None


def test_multimodal_wrapper_checks_its_text_config():
    import transformers

    cfg = transformers.Qwen3_5Config(text_config={"hidden_size": H, "num_hidden_layers": 4, "vocab_size": V})
    assert "linear-attention" in layouts.target_problem(cfg)
    assert "linear-attention" in layouts.target_problem(cfg.to_dict())


def test_moe_block_experts_are_fused_as_transformers_does(tmp_path):
    """GLM-4.5's layout on a mixture-of-experts target: the checkpoint holds one tensor per expert,
    transformers' layer 3-D expert parameters. The MTP block here is a copy of the target's MoE layer
    as save_pretrained writes it, so the converted block must equal that layer."""
    from safetensors.torch import load_file
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    torch.manual_seed(0)
    target = Glm4MoeForCausalLM(Glm4MoeConfig(
        vocab_size=V, hidden_size=H, intermediate_size=FFN, moe_intermediate_size=16, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, n_shared_experts=1,
        tie_word_embeddings=False)).eval()
    for p in target.parameters():  # no zero-initialised router bias or experts
        p.data.normal_(0, 0.2)
    folder = tmp_path / "glm"
    target.save_pretrained(folder)
    state = load_file(str(folder / "model.safetensors"))
    src, dst = "model.layers.1.", f"model.layers.{LAYERS}."
    assert f"{src}mlp.experts.0.gate_proj.weight" in state  # the per-expert checkpoint naming
    extra = {dst + k[len(src):]: v.clone() for k, v in state.items() if k.startswith(src)}
    g = torch.Generator().manual_seed(4)
    extra |= {dst + "enorm.weight": torch.randn(H, generator=g), dst + "hnorm.weight": torch.randn(H, generator=g),
              dst + "eh_proj.weight": torch.randn(H, 2 * H, generator=g),
              dst + "shared_head.norm.weight": torch.randn(H, generator=g),
              dst + "shared_head.head.weight": state["lm_head.weight"].clone()}
    write_checkpoint(folder, target, extra, {"num_nextn_predict_layers": 1})

    head, spec = layouts.read_mtp_head(folder, target)
    assert spec.block == "Glm4MoeDecoderLayer" and not spec.own_head
    want = target.model.layers[1].state_dict()
    got = head.block.state_dict()
    assert sorted(got) == sorted(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=0, rtol=0)
    x = torch.randn(1, 5, H, generator=g)
    pe = target.model.rotary_emb(x, torch.arange(5)[None])
    head.set_attention("sdpa")
    target.config._attn_implementation = "sdpa"
    with torch.no_grad():
        out = head.block(x, position_embeddings=pe)
        ref = target.model.layers[1](x, position_embeddings=pe)
    torch.testing.assert_close(out[0] if isinstance(out, tuple) else out, ref[0] if isinstance(ref, tuple) else ref)

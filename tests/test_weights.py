"""A GGUF file imported in its own format (host/weights.py, host/store.py): tiny random Llama,
Qwen2 and Mistral checkpoints written here with gguf.GGUFWriter (block tensors of every format
with a kernel, one without) import with their blocks kept and decode to the bits of their float32
import; the default model's native import is that file's size."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from host import store
from host.errors import ImportFailed, InvalidArgument
from host.engine import Engine, Pass, blocks

SHIPPED = store._alias_file(store.DEFAULT_MODEL)
HIDDEN, HEADS, KV_HEADS, INTER, LAYERS = 128, 4, 2, 256, 2
# per layer tensor -> its type: the legacy formats and 16-bit floats, and Q5_0 (no kernel: widened
# at import); q/k/v and gate/up in mixed formats, so run apart
TYPES = {"attn_q": T.Q4_0, "attn_k": T.F16, "attn_v": T.Q4_0, "attn_output": T.Q8_0,
         "ffn_gate": T.Q4_1, "ffn_up": T.BF16, "ffn_down": T.Q5_0}
# every format with 8-bit activations, and one without (BF16), for --activations q8
Q8_MIX = {"attn_q": T.Q4_K, "attn_k": T.Q4_0, "attn_v": T.Q6_K, "attn_output": T.Q8_0,
          "ffn_gate": T.Q4_1, "ffn_up": T.Q5_K, "ffn_down": (T.Q6_K, T.BF16)}
# a Q4_K_M-style mix, as llama.cpp writes one: Q4_K, with Q6_K for attention values and half the
# feed-forward downs (Q5_K for the other half here, to cover it); a tensor's type per layer
K_TYPES = {"attn_q": T.Q4_K, "attn_k": T.Q4_K, "attn_v": T.Q6_K, "attn_output": T.Q4_K,
           "ffn_gate": T.Q4_K, "ffn_up": T.Q4_K, "ffn_down": (T.Q6_K, T.Q5_K)}


def write_tiny_gguf(path: Path, arch: str, *, tied: bool, biases: bool, name: str = "tiny", types=None,
                    hidden: int = HIDDEN, inter: int = INTER, embedding: T = T.Q8_0) -> None:
    """A random checkpoint with the shipped model's tokenizer (its vocabulary and chat template).
    K-quant tensors (which gguf-py cannot quantize) are random super-blocks with small scales."""
    types = TYPES if types is None else types
    src = gguf.GGUFReader(SHIPPED)
    f = {k: v.contents() for k, v in src.fields.items() if k.startswith("tokenizer.")}
    vocab = len(f["tokenizer.ggml.tokens"])
    w = gguf.GGUFWriter(path, arch)
    w.add_name(name)
    w.add_block_count(LAYERS)
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model(f["tokenizer.ggml.model"])
    w.add_tokenizer_pre(f["tokenizer.ggml.pre"])
    w.add_token_list(f["tokenizer.ggml.tokens"])
    w.add_token_types(f["tokenizer.ggml.token_type"])
    w.add_token_merges(f["tokenizer.ggml.merges"])
    w.add_bos_token_id(f["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(f["tokenizer.ggml.eos_token_id"])
    w.add_pad_token_id(f["tokenizer.ggml.padding_token_id"])
    w.add_add_bos_token(False)
    w.add_chat_template(f["tokenizer.chat_template"])
    rng = np.random.default_rng(0)

    def add(tname: str, shape: tuple[int, ...], kind: T, scale: float = 0.08) -> None:
        fmt = blocks.format_of(kind)
        if fmt is not None and fmt.block_weights == 256:
            raw = rng.integers(0, 256, size=(shape[0], shape[1] // 256, fmt.block_bytes), dtype=np.uint8)
            for at in fmt.float16_at:  # a weight is at most ~63 * 15 scales
                d = (np.abs(rng.standard_normal(raw.shape[:2])) * scale / 400).astype(np.float16)
                raw[..., at:at + 2] = d[..., None].view(np.uint8)
            w.add_tensor(tname, raw.reshape(shape[0], -1), raw_dtype=kind)
            return
        data = (rng.standard_normal(shape) * scale).astype(np.float32)
        if kind == T.F32:
            w.add_tensor(tname, data)
        else:
            w.add_tensor(tname, gguf.quants.quantize(data, kind), raw_dtype=kind)

    add("token_embd.weight", (vocab, hidden), embedding, 1.0)
    if not tied:
        add("output.weight", (vocab, hidden), T.Q6_K if embedding == T.Q4_K else T.Q8_0)
    add("output_norm.weight", (hidden,), T.F32, 1.0)
    hd = hidden // HEADS
    shapes = {"attn_q": (hidden, hidden), "attn_k": (KV_HEADS * hd, hidden), "attn_v": (KV_HEADS * hd, hidden),
              "attn_output": (hidden, hidden), "ffn_gate": (inter, hidden), "ffn_up": (inter, hidden),
              "ffn_down": (hidden, inter)}
    for i in range(LAYERS):
        add(f"blk.{i}.attn_norm.weight", (hidden,), T.F32, 1.0)
        add(f"blk.{i}.ffn_norm.weight", (hidden,), T.F32, 1.0)
        for t, shape in shapes.items():
            kind = types[t][i % len(types[t])] if isinstance(types[t], tuple) else types[t]
            add(f"blk.{i}.{t}.weight", shape, kind)
        if biases:
            for t in ("attn_q", "attn_k", "attn_v"):
                add(f"blk.{i}.{t}.bias", (shapes[t][0],), T.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def assert_decodes_alike(a, b, ids: list[int], n: int) -> None:
    """Engines a and b decode the same n tokens after ids, every pass's logits bit for bit."""
    toks_a, logits_a = greedy(a, ids, n)
    toks_b, logits_b = greedy(b, ids, n)
    assert toks_a == toks_b
    assert all(torch.equal(x, y) for x, y in zip(logits_a, logits_b))


def greedy(engine, ids: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    ws = engine.new_working_set()
    try:
        r = engine.forward([Pass(ws, ids, list(range(len(ids))))])[0]
        logits, toks = [r.logits], []
        for _ in range(n):
            toks.append(int(logits[-1][-1].argmax()))
            r = engine.forward([Pass(ws, [toks[-1]], [0])])[0]
            logits.append(r.logits)
        return toks, logits
    finally:
        engine.release(ws)


@pytest.mark.parametrize("arch,tied,biases,name", [("llama", True, False, "tiny"), ("qwen2", False, True, "tiny"),
                                                   ("llama", False, False, "mistral")],
                         ids=["llama", "qwen2", "mistral"])
def test_a_gguf_keeps_its_blocks_and_decodes_as_its_float32_import(tmp_path, monkeypatch, caplog, arch, tied,
                                                                   biases, name):
    monkeypatch.setenv("PIE_HOME", str(tmp_path / "home"))
    path = tmp_path / f"{arch}.gguf"
    write_tiny_gguf(path, arch, tied=tied, biases=biases, name=name)
    native, _ = store.import_model(str(path), name="native", drafter=[], progress=False)
    assert "Q5_0 (2 tensors)" in caplog.text  # the type without a kernel, named
    want_arch = {"llama": "MistralForCausalLM" if name == "mistral" else "LlamaForCausalLM",
                 "qwen2": "Qwen2ForCausalLM"}[arch]
    assert native.architecture == want_arch
    assert {blocks.FORMATS[k].name for k in native.formats.values()} == {"Q8_0", "Q4_0", "Q4_1", "F16", "BF16"}
    a = store.open_engine("native", device="cpu", dtype="float32", kv_pages=64)
    assert isinstance(a.model.get_input_embeddings(), blocks.BlockEmbedding)
    assert a.stack.native is not None  # the C++ layer loop, mixed siblings run apart
    if tied:  # the readout streams the embedding's own blocks
        assert a.model.lm_head.packed is a.model.get_input_embeddings().packed
    if name == "mistral":  # transformers cannot import a Mistral GGUF (its name map asks gguf-py for "mistral")
        b = Engine(store.load_model(native, keep_blocks=False), a.tokenizer, name="widened", kv_pages=64)
    else:
        widened, _ = store.import_model(str(path), name="widened", dtype="float32", drafter=[], progress=False)
        assert native.architecture == widened.architecture and not widened.formats
        assert native.parameters == widened.parameters and native.bytes < widened.bytes / 3
        b = store.open_engine("widened", device="cpu", dtype="float32", kv_pages=64)
    assert_decodes_alike(a, b, a.tokenizer("The capital of France is")["input_ids"], 12)


@pytest.mark.parametrize("arch,tied,biases", [("llama", True, False), ("qwen2", False, True)], ids=["llama", "qwen2"])
def test_a_k_quant_mix_keeps_its_blocks_and_decodes_as_its_float32_import(tmp_path, monkeypatch, caplog, arch,
                                                                          tied, biases):
    monkeypatch.setenv("PIE_HOME", str(tmp_path / "home"))
    path = tmp_path / f"{arch}-q4_k_m.gguf"
    write_tiny_gguf(path, arch, tied=tied, biases=biases, types=K_TYPES, hidden=256, inter=512, embedding=T.Q4_K)
    native, _ = store.import_model(str(path), name="native", drafter=[], progress=False)
    assert "widened" not in caplog.text  # every type has a kernel
    want = {"Q4_K", "Q5_K", "Q6_K"}
    assert {blocks.FORMATS[k].name for k in native.formats.values()} == want
    widened, _ = store.import_model(str(path), name="widened", dtype="float32", drafter=[], progress=False)
    assert native.parameters == widened.parameters and native.bytes < widened.bytes / 3
    a = store.open_engine("native", device="cpu", dtype="float32", kv_pages=64)
    assert a.stack.native is not None  # the C++ layer loop, q and k apart from v (Q6_K)
    b = store.open_engine("widened", device="cpu", dtype="float32", kv_pages=64)
    assert_decodes_alike(a, b, a.tokenizer("The capital of France is")["input_ids"], 12)


def test_the_default_models_native_import_is_the_files_size(tmp_path, monkeypatch):
    monkeypatch.setenv("PIE_HOME", str(tmp_path))
    rec, _ = store.import_model(store.DEFAULT_MODEL, drafter=[], progress=False)
    assert {blocks.FORMATS[k].name for k in rec.formats.values()} == {"Q4_1", "Q8_0"}
    assert len(rec.formats) == 211
    assert rec.bytes <= SHIPPED.stat().st_size  # the blocks as stored, the norms beside them


def test_a_widened_import_is_made_again_as_stored_when_auto_asks(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("PIE_HOME", str(tmp_path / "home"))
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "llama", tied=True, biases=False)
    wide, _ = store.import_model(str(path), name="m", dtype="float32", drafter=[], progress=False)
    assert not wide.native and not wide.formats
    again, created = store.import_model(str(path), name="m", dtype="float32", drafter=[], progress=False)
    assert not created and again.bytes == wide.bytes  # as asked already: kept
    native, created = store.import_model(str(path), name="m", drafter=[], progress=False)  # auto: as stored
    assert created and native.native and native.formats and "stored as float32" in caplog.text
    assert store.read_record("m").native and native.bytes < wide.bytes / 3
    assert not [p for p in (tmp_path / "home" / "models").iterdir() if p.name.startswith(".")]  # nothing left over
    with pytest.raises(ImportFailed, match=r"different model .*Q4_0 .*not --dtype float32"):
        store.import_model(str(path), name="m", dtype="float32", drafter=[], progress=False)
    assert store.import_model(str(path), name="m", drafter=[], progress=False)[1] is False


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_a_16_bit_checkpoint_is_kept_as_stored_and_decodes_as_its_float32_import(tmp_path, monkeypatch, dtype):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    monkeypatch.setenv("PIE_HOME", str(tmp_path / "home"))
    src = tmp_path / "tiny16"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
                     ).to(dtype).save_pretrained(src)
    tk = Tokenizer(models.WordLevel({f"w{i}": i for i in range(96)} | {"[UNK]": 0}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="w2").save_pretrained(src)
    narrow, _ = store.import_model(str(src), name="narrow", drafter=[], progress=False)
    name = {torch.bfloat16: "BF16", torch.float16: "F16"}[dtype]
    assert narrow.native and {blocks.FORMATS[k].name for k in narrow.formats.values()} == {name}
    assert narrow.format_summary().startswith(f"{name} x15")  # 7 linears a layer and the embedding
    wide, _ = store.import_model(str(src), name="wide", dtype="float32", drafter=[], progress=False)
    assert narrow.parameters == wide.parameters and narrow.bytes < 0.6 * wide.bytes
    a = store.open_engine("narrow", device="cpu", dtype="float32", kv_pages=64)
    assert isinstance(a.model.get_input_embeddings(), blocks.BlockEmbedding) and a.stack.native is not None
    b = store.open_engine("wide", device="cpu", dtype="float32", kv_pages=64)
    assert_decodes_alike(a, b, [5, 17, 33, 8, 61], 10)


def test_a_gguf_imported_with_8_bit_activations_is_an_entry_of_its_own(tmp_path, monkeypatch):
    """--activations q8: the legacy blocks' products quantize each row's activations; an entry of
    its own beside the exact one, never in its place. A window's rows have the bits of the same
    rows decoded one at a time, so speculation stays exact in this arithmetic too."""
    monkeypatch.setenv("PIE_HOME", str(tmp_path / "home"))
    path = tmp_path / "llama.gguf"
    write_tiny_gguf(path, "llama", tied=True, biases=False, types=Q8_MIX, hidden=256, inter=512)
    q8, _ = store.import_model(str(path), drafter=[], progress=False, activations="q8")
    assert (q8.name, q8.activations) == ("llama-q8", "q8") and "8-bit activations" in q8.format_summary()
    exact, _ = store.import_model(str(path), drafter=[], progress=False)
    assert (exact.name, exact.activations) == ("llama", "exact")
    with pytest.raises(ImportFailed, match="--activations exact, not q8"):
        store.import_model(str(path), name="llama", drafter=[], progress=False, activations="q8")
    with pytest.raises(InvalidArgument, match="--dtype auto"):
        store.import_model(str(path), name="wide", dtype="float32", drafter=[], progress=False, activations="q8")
    with pytest.raises(InvalidArgument, match="one of exact, q8"):
        store.import_model(str(path), name="q4", drafter=[], progress=False, activations="q4")
    a = store.open_engine("llama-q8", device="cpu", dtype="float32", kv_pages=64)
    b = store.open_engine("llama", device="cpu", dtype="float32", kv_pages=64)
    assert a.model.get_input_embeddings().format == blocks.Q8_ACTIVATIONS + T.Q8_0
    layer = a.model.model.layers[1]
    assert layer.self_attn.v_proj.format == blocks.Q8_ACTIVATIONS + T.Q6_K
    assert layer.mlp.down_proj.format == T.BF16  # no such kernel: exact, beside the others
    assert a.model.lm_head.packed is a.model.get_input_embeddings().packed
    assert a.stack.native is not None
    ids = a.tokenizer("The capital of France is")["input_ids"]
    toks, logits = greedy(a, ids, 6)
    ws = a.new_working_set()
    try:
        window = a.forward([Pass(ws, ids + toks[:-1], list(range(len(ids) + 5)))])[0].logits
    finally:
        a.release(ws)
    assert torch.equal(window[:len(ids)], logits[0])
    assert all(torch.equal(window[len(ids) - 1 + j], logits[j][0]) for j in range(1, 6))
    exact_logits = greedy(b, ids, 0)[1][0][-1]
    assert not torch.equal(logits[0][-1], exact_logits)  # another arithmetic
    assert torch.nn.functional.cosine_similarity(logits[0][-1], exact_logits, dim=0) > 0.99

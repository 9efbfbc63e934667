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
from host.engine import Engine, Pass, blocks

SHIPPED = store._alias_file(store.DEFAULT_MODEL)
HIDDEN, HEADS, KV_HEADS, INTER, LAYERS = 128, 4, 2, 256, 2
# per layer tensor -> its type: every kernel's format, and Q5_0 (no kernel: widened at import)
TYPES = {"attn_q": T.Q4_0, "attn_k": T.Q4_0, "attn_v": T.Q4_0, "attn_output": T.Q8_0,
         "ffn_gate": T.Q4_1, "ffn_up": T.Q4_1, "ffn_down": T.Q5_0}


def write_tiny_gguf(path: Path, arch: str, *, tied: bool, biases: bool, name: str = "tiny") -> None:
    """A random checkpoint with the shipped model's tokenizer (its vocabulary and chat template)."""
    src = gguf.GGUFReader(SHIPPED)
    f = {k: v.contents() for k, v in src.fields.items() if k.startswith("tokenizer.")}
    vocab = len(f["tokenizer.ggml.tokens"])
    w = gguf.GGUFWriter(path, arch)
    w.add_name(name)
    w.add_block_count(LAYERS)
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
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
        data = (rng.standard_normal(shape) * scale).astype(np.float32)
        if kind == T.F32:
            w.add_tensor(tname, data)
        else:
            w.add_tensor(tname, gguf.quants.quantize(data, kind), raw_dtype=kind)

    add("token_embd.weight", (vocab, HIDDEN), T.Q8_0, 1.0)
    if not tied:
        add("output.weight", (vocab, HIDDEN), T.Q8_0)
    add("output_norm.weight", (HIDDEN,), T.F32, 1.0)
    hd = HIDDEN // HEADS
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * hd, HIDDEN), "attn_v": (KV_HEADS * hd, HIDDEN),
              "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (INTER, HIDDEN), "ffn_up": (INTER, HIDDEN),
              "ffn_down": (HIDDEN, INTER)}
    for i in range(LAYERS):
        add(f"blk.{i}.attn_norm.weight", (HIDDEN,), T.F32, 1.0)
        add(f"blk.{i}.ffn_norm.weight", (HIDDEN,), T.F32, 1.0)
        for t, shape in shapes.items():
            add(f"blk.{i}.{t}.weight", shape, TYPES[t])
        if biases:
            for t in ("attn_q", "attn_k", "attn_v"):
                add(f"blk.{i}.{t}.bias", (shapes[t][0],), T.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


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
    assert {blocks.FORMATS[k].name for k in native.formats.values()} == {"Q8_0", "Q4_0", "Q4_1"}
    a = store.open_engine("native", device="cpu", dtype="float32", kv_pages=64)
    assert isinstance(a.model.get_input_embeddings(), blocks.BlockEmbedding)
    if tied:  # the readout streams the embedding's own blocks
        assert a.model.lm_head.packed is a.model.get_input_embeddings().packed
    if name == "mistral":  # transformers cannot import a Mistral GGUF (its name map asks gguf-py for "mistral")
        b = Engine(store.load_model(native, keep_blocks=False), a.tokenizer, name="widened", kv_pages=64)
    else:
        widened, _ = store.import_model(str(path), name="widened", dtype="float32", drafter=[], progress=False)
        assert native.architecture == widened.architecture and not widened.formats
        assert native.parameters == widened.parameters and native.bytes < widened.bytes / 3
        b = store.open_engine("widened", device="cpu", dtype="float32", kv_pages=64)
    ids = a.tokenizer("The capital of France is")["input_ids"]
    toks_a, logits_a = greedy(a, ids, 12)
    toks_b, logits_b = greedy(b, ids, 12)
    assert toks_a == toks_b
    assert all(torch.equal(x, y) for x, y in zip(logits_a, logits_b))


def test_the_default_models_native_import_is_the_files_size(tmp_path, monkeypatch):
    monkeypatch.setenv("PIE_HOME", str(tmp_path))
    rec, _ = store.import_model(store.DEFAULT_MODEL, drafter=[], progress=False)
    assert {blocks.FORMATS[k].name for k in rec.formats.values()} == {"Q4_1", "Q8_0"}
    assert len(rec.formats) == 211
    assert rec.bytes <= SHIPPED.stat().st_size  # the blocks as stored, the norms beside them

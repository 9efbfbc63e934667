"""Shared fixtures: a tiny random Llama (fast, exact reference) and the real default model."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

DATA = Path(__file__).resolve().parents[1] / "data" / "specbench-dev.jsonl"


def dev_prompts() -> list[dict]:
    with open(DATA) as f:
        return [json.loads(line) for line in f]


@pytest.fixture
def tiny():
    """(engine, reference model) over the same random weights; the engine pool is small on purpose."""
    from transformers import LlamaForCausalLM

    from host.conformance.models import TinyTokenizer, tiny_config
    from host.engine import Engine

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config()).eval()
    ref = copy.deepcopy(model)
    ref.config._attn_implementation = "eager"

    eng = Engine(model, TinyTokenizer(), name="tiny", kv_pages=16, page_size=4)
    return eng, ref


@pytest.fixture(params=["host-scalars", "device-scalars"])
def scalar_path(request, monkeypatch):
    """Run a test twice: as on the CPU, where scalar results of epilogue ops move to the host at
    once, and as on CUDA, where they stay on the device until the batch's readback."""
    from host.epilogue import compile as executor

    if request.param == "device-scalars":
        monkeypatch.setattr(executor, "HOST_READABLE", ())
    return request.param


@pytest.fixture(scope="session")
def engine():
    """The default model in float32, imported into the store first if needed (again if the store
    holds another import of it): the native one, its file's blocks kept."""
    from host import store

    rec, _ = store.import_model(store.DEFAULT_MODEL, progress=False)
    assert rec.native and rec.formats, f"the default model should be stored native, not as {rec.format_summary()}"
    return store.open_engine(dtype="float32", device="cpu", kv_pages=1024)


@pytest.fixture(scope="session")
def chat_ids(engine) -> list[list[int]]:
    """Token ids of every dev prompt wrapped as one user turn in the chat template."""
    tok = engine.tokenizer
    out = []
    for p in dev_prompts():
        ids = tok.apply_chat_template([{"role": "user", "content": p["prompt"]}], add_generation_prompt=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


_HF_CACHE: dict = {}


@pytest.fixture(scope="session")
def hf_greedy(engine, chat_ids):
    """hf_greedy(i, n): HF generate(do_sample=False) continuation of dev prompt i, computed once per session."""

    from host import store

    from host.engine.compute import compute

    rec = store.read_record(engine.info.name)
    # model work on the compute thread, as the engine does it (host/engine/compute.py); a GGUF
    # import's blocks widened: transformers' own layers over the exact dequantized weights
    ref = compute().call(lambda: store.load_model(rec, "cpu", "float32", keep_blocks=False).eval())

    @torch.inference_mode()
    def generate(ids: list[int], n: int) -> list[int]:
        x = torch.tensor([ids])
        out = ref.generate(x, max_new_tokens=n, do_sample=False, attention_mask=torch.ones_like(x))
        return out[0, len(ids):].tolist()

    def get(i: int, n: int) -> list[int]:
        key = (i, n)
        if key not in _HF_CACHE:
            _HF_CACHE[key] = compute().call(generate, chat_ids[i], n)
        return _HF_CACHE[key]

    return get

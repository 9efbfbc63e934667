"""A store entry's weights in their file's own format: read from a GGUF file keeping each tensor's
blocks (or from a bfloat16/float16 checkpoint keeping its 16-bit weights), and loaded into a
transformers model that computes with them (host/engine/blocks.py).

An entry imported this way holds `weights.safetensors`: the block tensors as their GGUF rows
(uint8 [N, row bytes], after transformers' name mapping and its q/k row permutation, which moves
whole rows and so leaves every block intact) and every other tensor in float32. The file's
metadata names each block tensor's ggml type (`FORMATS_KEY`), as the entry's record does. A type without a kernel is widened at import,
and the import says which.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import torch

from .engine import blocks

WEIGHTS = "weights.safetensors"
FORMATS_KEY = "pie.formats"  # the file's metadata: JSON {tensor name: ggml type}
FLOAT_TYPES = ("F32", "F16", "BF16")  # GGUF types that are plain floats, read as float32


def _meta_model(config):
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):  # the rotary tables stay real
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def read_gguf(path: Path, config) -> tuple[dict[str, torch.Tensor], dict[str, int], Counter]:
    """(tensors by transformers name, ggml type of those kept in blocks, counts of the quantized
    types that were widened to float32 for want of a kernel)."""
    from gguf import GGUFReader, dequantize
    from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, LlamaTensorProcessor,
                                                          TensorProcessor, get_gguf_hf_weights_map,
                                                          load_gguf_checkpoint, read_field)

    reader = GGUFReader(path)
    parsed = load_gguf_checkpoint(str(path), return_tensors=False)
    arch = read_field(reader, "general.architecture")[0]
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=parsed["config"])
    # processors that only reorder whole rows may be given a tensor's blocks too
    rowwise = type(processor) in (TensorProcessor, LlamaTensorProcessor)
    meta = _meta_model(config)
    mapping = get_gguf_hf_weights_map(meta, processor, model_type=arch)  # the file's name (llama for Mistral)
    modules = dict(meta.named_modules())
    tensors, formats, widened = {}, {}, Counter()
    for t in reader.tensors:
        kind = int(t.tensor_type)
        dense = dequantize(t.data, t.tensor_type)
        out = processor.process(weights=dense, name=t.name, tensor_key_mapping=mapping, parsed_parameters=parsed)
        if out.name not in mapping:
            continue
        name = mapping[out.name]
        owner = modules.get(name.rpartition(".")[0])
        if (rowwise and blocks.format_of(kind) is not None and name.endswith(".weight") and dense.ndim == 2
                and isinstance(owner, (torch.nn.Linear, torch.nn.Embedding))):
            rows = processor.process(weights=np.asarray(t.data), name=t.name, tensor_key_mapping=mapping,
                                     parsed_parameters=parsed).weights
            raw = torch.from_numpy(np.ascontiguousarray(rows).view(np.uint8).copy())  # F16 rows come as float16
            # the blocks must widen to exactly what the float32 import would hold
            if (raw.shape[1] % blocks.FORMATS[kind].block_bytes == 0 and torch.equal(
                    blocks.dequantize(raw, kind), torch.from_numpy(np.ascontiguousarray(out.weights, dtype=np.float32)))):
                tensors[name], formats[name] = raw, kind
                continue
        if t.tensor_type.name not in FLOAT_TYPES:
            widened[t.tensor_type.name] += 1
        tensors[name] = torch.from_numpy(np.array(out.weights, dtype=np.float32))
    missing = [k for k in meta.state_dict() if k not in tensors and not _tied(meta, k)]
    if missing:
        raise ValueError(f"the file has no tensor for {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")
    return tensors, formats, widened


def from_model(model) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """A loaded checkpoint's tensors as an entry holds them: each bfloat16 or float16 weight of a
    linear layer or an embedding as its rows' bytes (blocks.WIDE16's formats), where its rows are
    whole groups; everything else in float32."""
    modules = dict(model.named_modules())
    tensors, formats = {}, {}
    for name, t in model.state_dict().items():
        if _tied(model, name):
            continue
        owner = modules.get(name.rpartition(".")[0])
        kind = blocks.WIDE16.get(t.dtype)
        if (kind is not None and name.endswith(".weight") and t.ndim == 2
                and isinstance(owner, (torch.nn.Linear, torch.nn.Embedding))
                and t.shape[1] * 2 % blocks.FORMATS[kind].block_bytes == 0):
            tensors[name], formats[name] = t.contiguous().view(torch.uint8).clone(), kind
        else:
            tensors[name] = t.detach().float().contiguous()
    return tensors, formats


def _tied(model, name: str) -> bool:
    return bool(getattr(model.config, "tie_word_embeddings", False)) and name == "lm_head.weight"


def write(tensors: dict[str, torch.Tensor], formats: dict[str, int], dest: Path) -> int:
    """Save an entry's tensors; returns the bytes written."""
    import json

    from safetensors.torch import save_file

    save_file(tensors, dest / WEIGHTS, metadata={FORMATS_KEY: json.dumps(formats)})
    (dest / WEIGHTS).chmod(0o644)  # readable like the rest of the store
    return (dest / WEIGHTS).stat().st_size


def parameters(tensors: dict[str, torch.Tensor], formats: dict[str, int]) -> int:
    """The weights' count, a tensor in blocks counted by the weights its rows hold."""
    return sum(t.shape[0] * (t.shape[1] // blocks.FORMATS[formats[k]].block_bytes * blocks.FORMATS[formats[k]].block_weights)
               if k in formats else t.numel() for k, t in tensors.items())


def load(folder: Path, dtype: torch.dtype, device: torch.device, keep: bool = True, q8: bool = False):
    """The entry's transformers model on `device` in `dtype`. A GGUF import's block tensors stay in
    blocks where `keep` and the kernels compute in `dtype` on `device` (blocks.usable), their
    products with 8-bit activations where `q8` (blocks.q8_format); else they are widened to float32
    exactly and the model converted as any other."""
    import json

    from safetensors import safe_open
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    if not (folder / WEIGHTS).is_file():  # an entry transformers wrote (a model folder, --dtype float32)
        return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device)
    config = AutoConfig.from_pretrained(folder)
    model = _meta_model(config)
    with safe_open(folder / WEIGHTS, "pt") as f:
        formats = json.loads((f.metadata() or {}).get(FORMATS_KEY, "{}"))
    state = load_file(folder / WEIGHTS)
    keep = keep and blocks.usable(device, dtype)
    for name, kind in formats.items():
        raw = state.pop(name)
        if keep:
            blocks.install(model, name, raw, kind, state.pop(name.removesuffix("weight") + "bias", None), q8=q8)
        else:
            state[name] = blocks.dequantize(raw, kind)
    model.load_state_dict(state, assign=True, strict=False)
    if _tied(model, "lm_head.weight"):
        embed = model.get_input_embeddings()
        if isinstance(embed, blocks.BlockEmbedding):
            model.lm_head = blocks.tie(model.lm_head, embed)
        else:
            model.lm_head.weight = embed.weight
    left = [n for n, p in [*model.named_parameters(), *model.named_buffers()] if p.is_meta]
    if left:
        raise ValueError(f"{folder / WEIGHTS} lacks {', '.join(left[:4])}")
    if (folder / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(folder)
    return model.to(device=device, dtype=dtype).eval() if not keep else model.eval()

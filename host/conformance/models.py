"""The models cases run on, and the suite's reference for them: the same weights run by plain
transformers (eager attention, the whole sequence each time), independent of any host.

`tiny` is a 2-layer random Llama (vocabulary 97, context 128) built here, so the suite needs
no download and every case is fast; its tokenizer maps a character to its code mod 97 and
has no chat template. Its host-side pool is small on purpose (out-of-pages is cheap to reach).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from ..errors import InvalidArgument

TINY_PAGES, TINY_PAGE_SIZE = 32, 4  # 128 rows; an instance's default share (0.5) is 64


class TinyTokenizer:
    eos_token_id = 2

    def encode(self, text, add_special_tokens=False):
        return [ord(c) % 97 for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(map(str, ids))


class Reference:
    """Greedy decoding by the reference model, recomputing the whole sequence each step."""

    def __init__(self, model):
        self.model = model

    @torch.inference_mode()
    def next_tokens(self, ids: list[int]) -> list[int]:
        """For each position i, the argmax next token after ids[:i+1] (ties: the lowest id)."""
        logits = self.model(torch.tensor([ids])).logits[0]
        return logits.argmax(-1).tolist()

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        ids = list(prompt)
        for _ in range(n):
            ids.append(self.next_tokens(ids)[-1])
        return ids[len(prompt):]


@dataclass
class SuiteModel:
    name: str
    model: object  # the transformers model a host loads (an in-process engine takes it over)
    tokenizer: object
    reference: Reference
    kv_pages: int
    page_size: int


def tiny_config():
    """The tiny random Llama's shape (the unit tests' `tiny` fixture builds the same model)."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                       eos_token_id=2, bos_token_id=1)


def _tiny() -> SuiteModel:
    from transformers import LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):  # the same weights every time, the caller's RNG untouched
        torch.manual_seed(0)
        model = LlamaForCausalLM(tiny_config()).eval()
    ref = copy.deepcopy(model)
    ref.config._attn_implementation = "eager"
    return SuiteModel("tiny", model, TinyTokenizer(), Reference(ref), TINY_PAGES, TINY_PAGE_SIZE)


MODELS = {"tiny": _tiny}


def suite_model(name: str) -> SuiteModel:
    if name not in MODELS:
        raise InvalidArgument(f"unknown conformance model {name!r}; known: {', '.join(MODELS)}")
    return MODELS[name]()

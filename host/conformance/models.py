"""The models cases run on, and the suite's reference for them: the same weights run by plain
transformers (eager attention, the whole sequence each time), independent of any host.

`tiny` is a 2-layer random Llama (vocabulary 97, context 128) built here, so the suite needs
no download and every case is fast; its tokenizer maps a character to its code mod 97 and
has no chat template; the grammar engine reads it through `grammar_tokens`. Its host-side pool
is small on purpose (out-of-pages is cheap to reach). It carries one MTP draft head, "mtp" (the
cases under drafter/ need it): built, not trained, so that it drafts each token's most frequent
successor in the model's own greedy text after HEAD_PROMPT; its drafts are then often accepted
there (and rejected elsewhere). The head changes nothing the target computes.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import InvalidArgument

TINY_PAGES, TINY_PAGE_SIZE = 32, 4  # 128 rows; an instance's default share (0.5) is 64
HEAD_NAME = "mtp"
HEAD_PROMPT, HEAD_TEXT_LEN = [7, 19, 23, 42, 5], 32  # the text the head learns its successors from


class TinyTokenizer:
    eos_token_id = 2

    def encode(self, text, add_special_tokens=False):
        return [ord(c) % 97 for c in text]

    def grammar_tokens(self) -> list[bytes]:
        """Each id's bytes, for the grammar engine (host/grammar): the one printable ASCII
        character encode() maps to the id (ids 0..29 are 'a'..'~', 32..96 are ' '..'`'), else
        the control character of that code (30, 31). 'c' has no token: its id is the EOS, whose
        bytes start with llguidance's special-token marker (0xff), so no grammar reads it as text."""
        out = [next((chr(o) for o in (t, t + 97) if 32 <= o < 127), chr(t)).encode() for t in range(97)]
        out[self.eos_token_id] = b"\xff<eos>"
        return out

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(map(str, ids))


class Reference:
    """Greedy decoding by the reference model, recomputing the whole sequence each step."""

    def __init__(self, model, tokenizer=None):
        self.model, self.tokenizer = model, tokenizer

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

    @torch.inference_mode()
    def constrained_greedy(self, prompt: list[int], n: int, regex: str) -> list[int]:
        """Greedy decoding under a regex: each step's argmax over the tokens the grammar allows
        (ties: the lowest id), from llguidance's own matcher over the tokenizer's
        `grammar_tokens`, not through the host's grammar engine."""
        import llguidance

        cfg = self.model.config
        m = llguidance.LLMatcher(_ll_tokenizer(self.tokenizer, cfg.vocab_size),
                                 llguidance.LLMatcher.grammar_from_regex(regex), log_level=0)
        ids = list(prompt)
        for _ in range(n):
            words = np.frombuffer(m.compute_bitmask(), dtype=np.uint32)
            allowed = torch.tensor([bool(words[t // 32] >> (t % 32) & 1) for t in range(cfg.vocab_size)])
            logits = self.model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.masked_fill(~allowed, float("-inf")).argmax()))
            if not m.consume_token(ids[-1]):
                raise AssertionError(f"the reference matcher refused its own choice {ids[-1]}: {m.get_error()}")
        return ids[len(prompt):]


def _ll_tokenizer(tokenizer, vocab_size: int):
    """llguidance's tokenizer for the suite's tokenizer: its grammar_tokens, encoded by its encode."""
    import llguidance

    class Wrapped:
        tokens, eos_token_id, bos_token_id = tokenizer.grammar_tokens(), tokenizer.eos_token_id, None

        def __call__(self, s):
            return tokenizer.encode(s.decode("utf-8") if isinstance(s, bytes) else s)

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(Wrapped()), n_vocab=vocab_size,
                                  eos_token=[tokenizer.eos_token_id])


@dataclass
class SuiteModel:
    name: str
    model: object  # the transformers model a host loads (an in-process engine takes it over)
    tokenizer: object
    reference: Reference
    kv_pages: int
    page_size: int
    heads: dict = field(default_factory=dict)  # draft heads by name (a host attaches them: Engine heads=)


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
    tok = TinyTokenizer()
    reference = Reference(ref, tok)
    head = successor_head(model, HEAD_PROMPT + reference.greedy(HEAD_PROMPT, HEAD_TEXT_LEN))
    return SuiteModel("tiny", model, tok, reference, TINY_PAGES, TINY_PAGE_SIZE, heads={HEAD_NAME: head})


@torch.no_grad()
def successor_head(model, text: list[int]):
    """An MTP head (host/drafter/mtp.py) over `model` whose drafts are restricted to the tokens of
    `text` and which drafts, after token t, t's most frequent successor in `text` (the first seen on
    ties), whatever the hidden state: its block is the identity (zero output projections), the hidden
    state's half of eh_proj and hnorm are zero, and eh_proj sends t's normalised embedding to the
    output row of its successor. Its other weights are seeded random (the caller's RNG untouched)."""
    from collections import Counter

    from ..drafter.mtp import MtpHead

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        head = MtpHead(model, draft_vocab=torch.tensor(sorted(set(text))))
    H = model.config.hidden_size
    for name in ("self_attn.o_proj", "mlp.down_proj"):
        head.block.get_submodule(name).weight.zero_()
    head.hnorm.weight.zero_()
    W, E = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    M = torch.zeros(H, H)
    for t in sorted(set(text)):
        nxt = Counter(b for a, b in zip(text, text[1:]) if a == t).most_common(1)
        if nxt:
            e = head.enorm(E[t])
            M += torch.outer(W[nxt[0][0]], e) / e.dot(e)
    head.eh_proj.weight.copy_(torch.cat([M, torch.zeros(H, H)], dim=1))
    return head.eval()


MODELS = {"tiny": _tiny}


def suite_model(name: str) -> SuiteModel:
    if name not in MODELS:
        raise InvalidArgument(f"unknown conformance model {name!r}; known: {', '.join(MODELS)}")
    return MODELS[name]()


def suite_engine(name: str = "tiny"):
    """An Engine over the suite model `name`, its heads attached: what a host process of its own
    (a replica of `pie serve --replicas` in the tests) builds."""
    from ..engine import Engine

    m = suite_model(name)
    return Engine(m.model, m.tokenizer, name=m.name, kv_pages=m.kv_pages, page_size=m.page_size, heads=m.heads)

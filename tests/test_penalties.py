"""Penalties in the one sampling rule (issue 53), through Wasm on the default model: greedy
text-completion under presence, frequency and repetition penalties equals HF generate under the
same penalties (HF's repetition processor; OpenAI's formula over the output as a logits
processor); every speculative inferlet's greedy output equals text-completion's under them; the
seeded guest and device loops draw the same tokens. The distribution test (verification under
penalties is lossless, and a rule that ignores them is caught) is in test_cacheback_program.py."""

from __future__ import annotations

import pytest
import torch

from conftest import dev_prompts
from wasm_fixtures import build_inferlet
from wasm_fixtures import *  # noqa: F401,F403 (fixtures)

pytestmark = [pytest.mark.wasm, pytest.mark.model]

N = 32
SETTINGS = {  # name -> (presence, frequency, repetition), dev prompt index
    "repetition": ((0.0, 0.0, 1.3), 0),
    "frequency": ((0.0, 0.8, 1.0), 3),
    "presence": ((1.2, 0.0, 1.0), 3),
    "all": ((-0.4, 0.5, 1.15), 0),
}


def _flags(setting: str) -> list[str]:
    pres, freq, rep = SETTINGS[setting][0]
    return ["--presence-penalty", repr(pres), "--frequency-penalty", repr(freq), "--repetition-penalty", repr(rep)]


def _args(i: int, *extra: str) -> list[str]:
    return ["--prompt", dev_prompts()[i]["prompt"], "--chat", "--max-tokens", str(N), *extra]


class OpenAIPenalties:
    """OpenAI's presence and frequency penalties over the tokens after `start`, as an HF logits
    processor (written apart from the engine's op)."""

    def __init__(self, start: int, presence: float, frequency: float):
        self.start, self.presence, self.frequency = start, presence, frequency

    def __call__(self, input_ids, scores):
        counts = torch.zeros_like(scores)
        counts.scatter_add_(1, input_ids[:, self.start:], torch.ones_like(input_ids[:, self.start:], dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


@pytest.fixture(scope="module")
def hf_penalized(engine, chat_ids):
    from transformers import LogitsProcessorList

    from host import store
    from host.engine.compute import compute

    rec = store.read_record(engine.info.name)
    ref = compute().call(lambda: store.load_model(rec, "cpu", "float32", keep_blocks=False).eval())

    @torch.inference_mode()
    def generate(setting: str) -> list[int]:
        (pres, freq, rep), i = SETTINGS[setting]
        ids = chat_ids[i]
        x = torch.tensor([ids])
        out = ref.generate(x, max_new_tokens=N, do_sample=False, attention_mask=torch.ones_like(x),
                           repetition_penalty=rep,
                           logits_processor=LogitsProcessorList([OpenAIPenalties(len(ids), pres, freq)]))
        return out[0, len(ids):].tolist()

    return lambda setting: compute().call(generate, setting)


@pytest.fixture(scope="module")
def penalized_runs(runtime, text_completion_wasm, drafter_name):
    """{(inferlet, setting): result}, started together so the engine batches them."""
    wasm = {name: build_inferlet(name) for name in ("cacheback-speculative-decoding", "mtp-speculative-decoding",
                                                      "ngram-proposer")}
    jobs = {"text-completion": (text_completion_wasm, ()), "guest-loop": (text_completion_wasm, ("--loop", "guest")),
            "cacheback": (wasm["cacheback-speculative-decoding"], ()),
            "hybrid": (wasm["cacheback-speculative-decoding"], ("--drafter", drafter_name)),
            "mtp": (wasm["mtp-speculative-decoding"], ()), "ngram-proposer": (wasm["ngram-proposer"], ())}
    runs = {}
    for setting, (_, i) in SETTINGS.items():
        hs = {(name, setting): runtime.start(w, _args(i, *extra, *_flags(setting))) for name, (w, extra) in jobs.items()}
        runs.update({k: h.result(timeout=900) for k, h in hs.items()})
    return runs


@pytest.fixture(scope="module")
def drafter_name(runtime):
    names = runtime.engine.info.drafters
    assert names, "the default model has no drafter: run `make model`"
    return names[0]


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_text_completion_under_penalties_equals_hf_generate(penalized_runs, hf_penalized, runtime,
                                                           text_completion_wasm, setting):
    r = penalized_runs[("text-completion", setting)]
    assert r.ok, r.error
    assert r.token_ids == hf_penalized(setting)
    # the penalties are felt: the text differs from plain decoding's
    assert runtime.run(text_completion_wasm, _args(SETTINGS[setting][1])).token_ids != r.token_ids


@pytest.mark.parametrize("name", ["guest-loop", "cacheback", "hybrid", "mtp", "ngram-proposer"])
def test_speculative_greedy_under_penalties_equals_plain(penalized_runs, name):
    drafted = 0
    for setting in SETTINGS:
        ref, r = penalized_runs[("text-completion", setting)], penalized_runs[(name, setting)]
        assert r.ok, r.error
        assert r.token_ids == ref.token_ids, setting
        drafted += r.stats["drafted_tokens"]
    assert name == "guest-loop" or drafted > 0


def test_constrained_under_penalties_equals_its_plain_decoding(runtime):
    import json

    wasm = build_inferlet("constrained-speculative-decoding")
    schema = json.dumps({"type": "object", "properties": {"name": {"type": "string"}, "tags": {
        "type": "array", "items": {"type": "string"}}}, "required": ["name", "tags"]})
    base = ["--prompt", "Describe a cat as JSON with a name and tags.", "--chat", "--max-tokens", "48",
            "--json-schema", schema, *_flags("all")]
    hs = [runtime.start(wasm, base + ["--draft-len", k]) for k in ("0", "6")]
    plain, spec = (h.result(timeout=600) for h in hs)
    assert plain.ok and spec.ok, (plain.error, spec.error)
    assert spec.token_ids == plain.token_ids


def test_seeded_guest_and_device_loops_draw_the_same_tokens(runtime, text_completion_wasm):
    sampled = ("--temperature", "0.9", "--seed", "11", *_flags("all"))
    hs = [runtime.start(text_completion_wasm, _args(3, *sampled, "--loop", loop)) for loop in ("device", "guest")]
    device, guest = (h.result(timeout=600) for h in hs)
    assert device.ok and guest.ok
    assert device.token_ids == guest.token_ids


def test_bad_penalties_are_usage_errors(runtime, text_completion_wasm):
    for flags, words in ((["--repetition-penalty", "0"], "--repetition-penalty must be > 0"),
                         (["--presence-penalty", "nan"], "not a valid finite number")):
        r = runtime.run(text_completion_wasm, _args(0, *flags))
        assert not r.ok and words in r.error
    r = runtime.run(build_inferlet("windowed-attention"), _args(0, "--presence-penalty", "0.5"))
    assert not r.ok and "takes no penalties" in r.error

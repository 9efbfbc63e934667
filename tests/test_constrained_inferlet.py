"""constrained-speculative-decoding through Wasm on the default model: every dev schema's finished
output validates; speculative greedy equals constrained plain decoding (draft length 0) token for
token; forced tokens are accepted drafts; regex and Lark grammars; seeded sampling repeats; bad
grammars are clean errors that disturb no other run."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from host.runtime.limits import Limits
from wasm_fixtures import build_inferlet
from wasm_fixtures import *  # noqa: F401,F403 (fixtures)

pytestmark = [pytest.mark.wasm, pytest.mark.model]

SCHEMAS = [json.loads(line) for line in (Path(__file__).resolve().parents[1] / "data" /
                                         "jsonschema-dev.jsonl").read_text().splitlines() if line.strip()]
N = 160  # most dev schemas' objects finish well within this
WAVE = 6  # schemas per wave: each starts K=8 and K=0 (12 instances batched together)
# a device loop is charged its share of every batched step it is part of: 12 loops of 160 steps
# on a busy 2-core machine; far from the default compute time, but the test must not depend on speed
LIMITS = Limits(compute_time_s=900.0)


def _args(prompt: str, n: int, *extra: str) -> list[str]:
    return ["--prompt", prompt, "--chat", "--max-tokens", str(n), *extra]


@pytest.fixture(scope="module")
def constrained_wasm():
    return build_inferlet("constrained-speculative-decoding")


@pytest.fixture(scope="module")
def schema_runs(runtime, constrained_wasm):
    """[(schema row, speculative result, plain result)] over every dev schema, greedy."""
    out = []
    for start in range(0, len(SCHEMAS), WAVE):
        wave = SCHEMAS[start:start + WAVE]
        hs = [(row, *[runtime.start(constrained_wasm, _args(row["prompt"], N, "--json-schema", json.dumps(row["schema"]),
                                                              "--draft-len", k), limits=LIMITS)
                               for k in ("8", "0")]) for row in wave]
        out += [(row, a.result(timeout=900), b.result(timeout=900)) for row, a, b in hs]
    return out


def test_every_finished_output_validates_against_its_schema(schema_runs):
    finished = 0
    for row, spec, plain in schema_runs:
        assert spec.ok and plain.ok, (row["id"], spec.error, plain.error)
        if spec.stats["finish"] == "stop":
            finished += 1
            jsonschema.validate(json.loads(spec.text), row["schema"])
        else:
            assert spec.stats["finish"] == "length" and len(spec.token_ids) == N, row["id"]
    # the small model writes some strings on and on: enough finish for the check above to mean something
    assert finished >= 10, f"only {finished} of {len(SCHEMAS)} finished within {N} tokens"


def test_speculative_greedy_equals_constrained_plain_decoding(schema_runs):
    for row, spec, plain in schema_runs:
        assert spec.token_ids == plain.token_ids, row["id"]
        assert plain.stats["drafted_tokens"] == 0
        s = spec.stats
        assert 0 <= s["accepted_tokens"] <= s["drafted_tokens"]
        assert s["generated_tokens"] <= s["accepted_tokens"] + s["passes"] - 1
    spec_passes = sum(s.stats["passes"] for _, s, _ in schema_runs)
    plain_passes = sum(p.stats["passes"] for _, _, p in schema_runs)
    assert spec_passes < 0.8 * plain_passes  # forced tokens and lookup drafts save passes


def test_forced_tokens_are_accepted_drafts(runtime, constrained_wasm):
    """The regex forces its literal prefix: the first window drafts it whole and the mask makes the
    target choose it, so every one is accepted."""
    literal = "The answer, in one word, is: "
    r = runtime.run(constrained_wasm, _args("Is the sky blue?", 24, "--regex", re.escape(literal) + "(yes|no)\\.",
                                            "--draft-len", "16"))
    assert r.ok, r.error
    assert r.text.startswith(literal) and re.fullmatch(re.escape(literal) + "(yes|no)\\.", r.text)
    assert r.stats["finish"] == "stop"
    forced = len(runtime.engine.tokenizer.encode(literal, add_special_tokens=False))
    assert r.stats["accepted_tokens"] >= forced - 1  # the prefix's last token may merge with what follows
    assert r.stats["passes"] <= r.stats["generated_tokens"] - forced + 3


def test_regex_and_lark_grammars(runtime, constrained_wasm):
    date = r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
    lark = 'start: "Colour: " COLOUR ", count: " NUMBER "."\nCOLOUR: "red" | "green" | "blue"\nNUMBER: /[1-9][0-9]?/\n'
    jobs = [("What is today's date? Answer with the date only.", "--regex", date),
            ("Name a colour and a small number.", "--grammar", lark)]
    hs = [runtime.start(constrained_wasm, _args(p, 40, flag, g)) for p, flag, g in jobs]
    got = [h.result(timeout=600) for h in hs]
    assert all(r.ok for r in got), [r.error for r in got]
    assert re.fullmatch(date, got[0].text), got[0].text
    assert re.fullmatch(r"Colour: (red|green|blue), count: [1-9][0-9]?\.", got[1].text), got[1].text
    assert all(r.stats["finish"] == "stop" for r in got)


def test_seeded_sampling_repeats_and_stays_valid(runtime, constrained_wasm):
    row = SCHEMAS[1]
    sampled = ("--temperature", "0.9", "--top-p", "0.95", "--json-schema", json.dumps(row["schema"]))
    hs = [runtime.start(constrained_wasm, _args(row["prompt"], N, *sampled, "--seed", s), limits=LIMITS)
          for s in ("7", "7", "8")]
    a, b, c = [h.result(timeout=600) for h in hs]
    assert a.ok and b.ok and c.ok, (a.error, b.error, c.error)
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids
    for r in (a, c):
        if r.stats["finish"] == "stop":
            jsonschema.validate(json.loads(r.text), row["schema"])


def test_a_cut_run_says_length(runtime, constrained_wasm):
    row = SCHEMAS[0]
    r = runtime.run(constrained_wasm, _args(row["prompt"], 6, "--json-schema", json.dumps(row["schema"])))
    assert r.ok, r.error
    assert len(r.token_ids) == 6 and r.stats["finish"] == "length"


@pytest.mark.parametrize("flag,source,message", [
    ("--json-schema", "{not json", "not valid JSON"),
    ("--json-schema", '{"type": 7}', "bad JSON schema"),
    ("--regex", "(unclosed", "bad regex"),
    ("--grammar", "start: missing_rule", "bad Lark grammar"),
])
def test_bad_grammars_fail_cleanly_and_disturb_nothing(runtime, text_completion_wasm, constrained_wasm, flag, source,
                                                      message):
    prompt = "Say hello."
    alone = runtime.run(text_completion_wasm, _args(prompt, 12))
    free = runtime.engine.pool.free_pages
    other = runtime.start(text_completion_wasm, _args(prompt, 12))
    bad = runtime.run(constrained_wasm, _args(prompt, 12, flag, source))
    assert not bad.ok and "invalid-argument" in bad.error and message in bad.error, bad.error
    assert other.result(timeout=600).token_ids == alone.token_ids
    assert runtime.engine.pool.free_pages == free

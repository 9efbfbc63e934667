"""`pie serve`: OpenAI's response_format (json_object, json_schema) is served by the
constrained-speculative-decoding inferlet: the output parses and satisfies the schema, equals
`pie run`'s, and a bad schema or format is a 400 that touches nothing."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from test_daemon import Served
from wasm_fixtures import *  # noqa: F401,F403
from wasm_fixtures import build_inferlet

pytestmark = [pytest.mark.model, pytest.mark.wasm]

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
MODEL = "smollm2-135m"
ASK = "Describe Alice, who is 31, as a JSON object with her name and age."


@pytest.fixture(scope="module")
def constrained_wasm():
    return build_inferlet("constrained-speculative-decoding")


@pytest.fixture(scope="module")
def served(runtime, text_completion_wasm, constrained_wasm):
    s = Served(runtime, text_completion_wasm, max_instances=2, builtin_dir=constrained_wasm.parent)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_json_schema_output_satisfies_the_schema_and_equals_pie_run(client, served, runtime, constrained_wasm):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK}],
                                          max_tokens=48, temperature=0, response_format=fmt)
    choice = resp.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    ref = runtime.run(constrained_wasm, ["--prompt", ASK, "--chat", "--max-tokens", "48",
                                         "--json-schema", json.dumps(SCHEMA)])
    assert ref.ok, ref.error
    assert choice.message.content == ref.text


def test_json_object_output_is_an_object(client, served):
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK}],
                                          max_tokens=48, temperature=0, response_format={"type": "json_object"})
    if resp.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(resp.choices[0].message.content), dict)
    else:
        assert resp.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("fmt,message", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}, "bad JSON schema"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "needs"),
    ({"type": "yaml"}, "not supported"),
])
def test_a_bad_format_is_a_400(client, served, runtime, fmt, message):
    free, started = runtime.engine.pool.free_pages, len(served.started)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK}],
                                       max_tokens=8, response_format=fmt)
    assert message in str(e.value) and e.value.body["param"] == "response_format"
    assert runtime.engine.pool.free_pages == free and len(served.started) == started  # refused before any instance

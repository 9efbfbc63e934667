"""Tool calling on /v1/chat/completions (issue 40) with the real `openai` client: calls valid by
construction under required, a named function and auto; none as if no tools were sent; a round
trip through a tool message; streamed calls (name first, then arguments in deltas); a named
function called exactly once; greedy speculative equal to constrained plain."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from test_daemon import Served, _error
from wasm_fixtures import *  # noqa: F401,F403

pytestmark = [pytest.mark.model, pytest.mark.wasm]

MODEL = "smollm2-135m"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def served(runtime, text_completion_wasm):
    s = Served(runtime, text_completion_wasm, max_instances=2, max_queue=8)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=300)


@pytest.fixture
def http(served):
    with httpx.Client(base_url=served.url, timeout=300) as c:
        yield c


def _calls(choice) -> list[tuple[str, dict]]:
    """(name, arguments) of each call, each checked against its tool's schema."""
    out = []
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        out.append((call.function.name, args))
    return out


@pytest.mark.parametrize("parallel", [True, False])
def test_required_gives_calls_that_validate(client, parallel):
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                         parallel_tool_calls=parallel, temperature=0, max_tokens=120)
    (choice,) = out.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = _calls(choice)
    assert calls and (parallel or len(calls) == 1)


def test_a_named_function_is_the_one_called(client):
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is 2 plus 3?"}],
                                         tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}},
                                         parallel_tool_calls=False, temperature=0, max_tokens=60)
    (choice,) = out.choices
    assert choice.finish_reason == "tool_calls"
    ((name, args),) = _calls(choice)
    assert name == "add" and set(args) == {"a", "b"}


@pytest.mark.parametrize("content", ["What is the weather in Paris?", "Say hello to me."])
def test_auto_answers_text_or_valid_calls(client, content, served):
    msgs = [{"role": "user", "content": content}]
    out = client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, temperature=0, max_tokens=60)
    (choice,) = out.choices
    if choice.message.tool_calls:
        assert choice.message.content is None and choice.finish_reason == "tool_calls"
        assert _calls(choice)
    else:
        assert choice.message.content and not choice.message.content.startswith("<")
        assert choice.finish_reason in ("stop", "length")


def test_none_is_as_if_no_tools_were_sent(client):
    kw = dict(model=MODEL, messages=ASK, temperature=0, max_tokens=12)
    plain = client.chat.completions.create(**kw)
    none = client.chat.completions.create(tools=TOOLS, tool_choice="none", **kw)
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert none.choices[0].message.tool_calls is None
    # the same tokens counted (the second request found the first's prompt in the prefix cache)
    assert (none.usage.prompt_tokens, none.usage.completion_tokens) == (plain.usage.prompt_tokens,
                                                                        plain.usage.completion_tokens)
    assert none.usage.prompt_tokens_details.cached_tokens > 0


def test_a_round_trip_through_a_tool_message(client, served):
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, temperature=0, max_tokens=120)
    call = first.choices[0].message.tool_calls[0]
    msgs = ASK + [first.choices[0].message.model_dump(exclude_none=True),  # content None: left out
                  {"role": "tool", "tool_call_id": call.id, "content": "22 degrees and sunny"}]
    assert msgs[1]["role"] == "assistant" and "content" not in msgs[1]
    out = client.chat.completions.create(model=MODEL, messages=msgs + [], tools=TOOLS, tool_choice="none",
                                         temperature=0, max_tokens=16)
    assert out.choices[0].message.content and out.choices[0].finish_reason in ("stop", "length")
    # what the model saw: the call as it wrote it, and the tool's answer
    from host.daemon.schemas import ChatMessage
    import asyncio
    rendered = asyncio.run(served.service.render_chat([ChatMessage(**m) for m in msgs]))
    assert f'"name": "{call.function.name}"' in rendered and "22 degrees and sunny" in rendered
    assert rendered.count("<tool_call>") == 1


def test_streamed_calls_equal_the_unstreamed_ones(client):
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=120)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    calls: dict[int, dict] = {}
    for c in chunks:
        for d in c.choices[0].delta.tool_calls or []:
            got = calls.setdefault(d.index, {"name": "", "arguments": ""})
            got["name"] += d.function.name or ""
            got["arguments"] += d.function.arguments or ""
        assert not c.choices[0].delta.content  # a call is never streamed as text
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == _calls(whole.choices[0])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_calls_stream_as_openai_streams_them(client):
    """Issue 53: the name first, then the arguments in deltas as they are generated."""
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
              temperature=0, max_tokens=80)
    deltas = [d for c in client.chat.completions.create(stream=True, **kw) if c.choices
              for d in c.choices[0].delta.tool_calls or []]
    first, rest = deltas[0], deltas[1:]
    assert first.function.name == "get_weather" and first.id.startswith("call_") and first.function.arguments == ""
    assert len(rest) > 1 and all(d.index == 0 and d.function.name is None for d in rest)
    jsonschema.validate(json.loads("".join(d.function.arguments for d in rest)), SCHEMAS["get_weather"])


def test_a_named_function_is_called_exactly_once(client):
    """Issue 53: with parallel calls allowed (the default) a named tool_choice still yields one call
    and ends (it used to start a second one and run into max_tokens)."""
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is 2 plus 3?"}],
                                         tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}},
                                         temperature=0, max_tokens=200)
    (choice,) = out.choices
    assert choice.finish_reason == "tool_calls" and out.usage.completion_tokens < 200
    ((name, _),) = _calls(choice)
    assert name == "add"


def test_call_stream_cuts_calls_wherever_the_text_is_cut():
    from host.daemon.tools import CLOSE, OPEN, CallStream

    text = (OPEN + '{"name": "get_weather", "arguments": {"city": "Pa\\"ris}", "unit": "celsius"}}' + CLOSE + "\n"
            + OPEN + '{"name": "add", "arguments": {"a": 2, "b": 3}}' + CLOSE)
    for step in (1, 2, 5, 13, len(text)):
        stream, calls = CallStream(), {}
        for i in range(0, len(text), step):
            for d in stream.push(text[i:i + step]):
                got = calls.setdefault(d["index"], {"name": d["function"].get("name"), "arguments": ""})
                got["arguments"] += d["function"]["arguments"]
        assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
            ("get_weather", {"city": 'Pa"ris}', "unit": "celsius"}), ("add", {"a": 2, "b": 3})], step


def test_speculative_calls_equal_constrained_plain_decoding(client):
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=120)
    spec = client.chat.completions.create(**kw)
    plain = client.chat.completions.create(extra_body={"inferlet_args": ["--draft-len", "0"]}, **kw)
    assert _calls(spec.choices[0]) == _calls(plain.choices[0])
    assert spec.usage.completion_tokens == plain.usage.completion_tokens


def test_bad_tool_requests_are_400(http):
    chat = {"model": MODEL, "messages": ASK, "max_tokens": 4}
    for body, param in (({"tool_choice": "required"}, "tool_choice"),
                        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                         "tool_choice"),
                        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
                        ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools"),
                        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
                        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}],
                          "tool_choice": "required"}, "tools")):
        err = _error(http.post("/v1/chat/completions", json=chat | body), 400)
        assert err["param"] == param, (body, err)
    bad_name = {"tools": [{"type": "function", "function": {"name": "two words"}}]}
    assert http.post("/v1/chat/completions", json=chat | bad_name).status_code in (400, 422)
    err = _error(http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "tools": TOOLS}), 400)
    assert err["param"] == "tools" and err["code"] == "unsupported_value"
    call = {"role": "assistant", "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{not json"}}]}
    err = _error(http.post("/v1/chat/completions", json=chat | {"messages": ASK + [call]}), 400)
    assert err["param"] == "messages"


@pytest.mark.parametrize("mode", ["auto", "required"])
def test_the_grammar_admits_valid_calls_and_nothing_else(engine, mode):
    """What auto and required let the model write, checked on the grammar itself (the small model
    seldom calls a tool under auto): a text answer under auto only, a call with valid arguments
    under both, and never a call with arguments outside its schema or an unknown tool."""
    from host.daemon import tools
    from host.daemon.schemas import ChatRequest
    from host.runtime.grammars import grammars_for

    req = ChatRequest(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=mode)
    lark = tools.grammar(req.tools, mode, None, parallel=True)
    grammar = grammars_for(engine).compile("lark", lark)
    eos = engine.info.eos_ids[0]

    def whole(text: str) -> bool:
        ids = engine.tokenizer.encode(text, add_special_tokens=False) + [eos]
        return grammar.matcher().validate(ids) == len(ids)
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    assert whole(call) and whole(call + "\n" + call.replace("add", "add"))
    assert whole("Hello there.") == (mode == "auto")
    assert not whole(call.replace('"b": 3', '"b": "three"'))  # arguments outside the schema
    assert not whole(call.replace("add", "mul"))  # no such tool
    assert not whole("<tool_call>\nnot json\n</tool_call>")


# ---- LangChain: bind_tools and with_structured_output(method="function_calling") ----------------

@pytest.fixture(scope="module")
def chat_model(served):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=served.url + "/v1", api_key="none", model=MODEL, temperature=0, max_tokens=120,
                      max_retries=0, timeout=300)


def test_langchain_bind_tools(chat_model):
    msg = chat_model.bind_tools(TOOLS, tool_choice="required").invoke("What is the weather in Paris?")
    assert msg.tool_calls and msg.response_metadata["finish_reason"] == "tool_calls"
    for call in msg.tool_calls:
        jsonschema.validate(call["args"], SCHEMAS[call["name"]])


def test_langchain_structured_output_through_a_function_call(chat_model):
    from pydantic import BaseModel, Field

    class City(BaseModel):
        """A city and its country."""

        name: str = Field(max_length=40)
        country: str = Field(max_length=40)

    out = chat_model.with_structured_output(City, method="function_calling").invoke("Name a city in France.")
    assert isinstance(out, City) and out.name and out.country


def test_pydantic_ai_tool_output(served):
    """Issue 53: pydantic-ai's default structured output (a `final_result` tool it requires) gives an
    object of the output type: the call's arguments validate by construction."""
    from pydantic import BaseModel
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    class City(BaseModel):
        name: str
        country: str

    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=served.url + "/v1", api_key="none"))
    agent = Agent(model, output_type=City, model_settings={"temperature": 0, "max_tokens": 120})
    out = agent.run_sync("What is the capital of France?").output
    assert isinstance(out, City) and out.name and out.country

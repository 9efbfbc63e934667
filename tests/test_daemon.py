"""`pie serve`: the OpenAI-compatible API, called with the real `openai` client and `httpx`
against a daemon on a free loopback port (uvicorn in a thread, over the session's runtime)."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from host.daemon.server import Daemon
from host.daemon.service import ServeConfig, Service
from wasm_fixtures import *  # noqa: F401,F403

pytestmark = [pytest.mark.model, pytest.mark.wasm]

KEY = "test-key-1"
QUESTION = "Why is the sky blue?"
# a greedy answer that runs for hundreds of tokens: an instance that is surely still running
LONG = "Write a long story about a dragon."


class Served:
    """A daemon running in a thread; `stop()` ends it and waits for its thread."""

    def __init__(self, runtime, wasm, **config):
        self.service = Service(runtime, ServeConfig(inferlet=wasm, **config))
        self.started = []  # every instance the server started (RunHandle), to see how each ended
        spawn = self.service.instances.spawn

        def spy(*a, **kw):
            handle = spawn(*a, **kw)
            self.started.append(handle)
            return handle
        self.service.instances.spawn = spy
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))  # a free port, held from here on: no race with another process
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.daemon = Daemon(self.service, log_level="warning")
        self.thread = threading.Thread(target=self.daemon.run, args=(sock,), daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.daemon.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the daemon did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.daemon.stop()
        self.thread.join(30)
        assert not self.thread.is_alive(), "the daemon did not stop"

    def wait_idle(self) -> None:
        """Until no instance runs (a cancelled one ends at its next host call)."""
        deadline = time.monotonic() + 30
        while self.service.instances.running:
            assert time.monotonic() < deadline, "an instance kept running"
            time.sleep(0.02)


@pytest.fixture(scope="module")
def served(runtime, text_completion_wasm):
    s = Served(runtime, text_completion_wasm, max_instances=1, max_queue=0, api_keys=[KEY, "another-key"])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture
def http(served):
    with httpx.Client(base_url=served.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def reference(runtime, text_completion_wasm):
    """reference(args): the text-completion run `pie run text-completion -- ARGS` does, in-process."""
    cache = {}

    def run(*args):
        if args not in cache:
            res = runtime.run(text_completion_wasm, list(args))
            assert res.ok, res.error
            cache[args] = res
        return cache[args]
    return run


def _error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"]
    return body["error"]


def _metrics(http) -> dict:
    """{(name, labels as a sorted tuple): value} of /metrics."""
    resp = http.get("/metrics")
    assert resp.status_code == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(resp.text) for s in fam.samples}


def _requests(m: dict, endpoint: str, status: int) -> float:
    return m.get(("pie:http_requests_total", (("endpoint", endpoint), ("status", str(status)))), 0.0)


# ---- the API ----------------------------------------------------------------------------------

def test_models(client, served):
    ids = [m.id for m in client.models.list().data]
    assert ids == [served.service.model] == ["smollm2-135m"]
    assert client.models.retrieve("smollm2-135m").id == "smollm2-135m"  # issue 40: was 404
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.code == "model_not_found"


def test_chat_greedy_equals_pie_run(client, reference, engine):
    ref = reference("--prompt", QUESTION, "--chat", "--max-tokens", "12")
    out = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": QUESTION}],
                                         max_tokens=12, temperature=0)
    assert out.object == "chat.completion" and len(out.choices) == 1
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref.text and ref.text
    assert out.choices[0].finish_reason == "length"
    ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True)
    n_prompt = len(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (n_prompt, 12, n_prompt + 12)


def test_chat_template_covers_every_message(client, engine):
    """The host renders the whole conversation (a system message too), not the last message alone."""
    msgs = [{"role": "system", "content": "You answer in French."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Bonjour !"}, {"role": "user", "content": QUESTION}]
    out = client.chat.completions.create(model="smollm2-135m", messages=msgs, max_completion_tokens=1, temperature=0)
    ids = engine.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
    assert out.usage.prompt_tokens == len(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert out.usage.completion_tokens == 1


def test_completion_greedy(client, reference):
    ref = reference("--prompt", "The capital of France is", "--max-tokens", "8")
    out = client.completions.create(model="smollm2-135m", prompt="The capital of France is", max_tokens=8,
                                    temperature=0)
    assert out.object == "text_completion"
    assert out.choices[0].text == ref.text and out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == len(ref.token_ids) == 8


def test_chat_stream_joins_to_the_text(client, reference):
    ref = reference("--prompt", QUESTION, "--chat", "--max-tokens", "12")
    chunks = list(client.chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": QUESTION}], max_tokens=12, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks) and len({c.id for c in chunks}) == 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1  # it streamed
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 12
    assert body[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in body)


def test_completion_stream_without_usage(client, reference):
    ref = reference("--prompt", "The capital of France is", "--max-tokens", "8")
    chunks = list(client.completions.create(model="smollm2-135m", prompt="The capital of France is", max_tokens=8,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string(client, reference, stream):
    ref = reference("--prompt", QUESTION, "--chat", "--max-tokens", "12").text
    words = ref.split()
    stop = " " + words[len(words) // 2]  # a word from the middle of the greedy answer
    want = ref[:ref.index(stop)]
    kw = dict(model="smollm2-135m", messages=[{"role": "user", "content": QUESTION}], max_tokens=12,
              temperature=0, stop=["never generated", stop])
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kw))
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        out = client.chat.completions.create(**kw)
        text, finish = out.choices[0].message.content, out.choices[0].finish_reason
    assert text == want and finish == "stop"


def test_sampled_with_a_seed_repeats(client):
    kw = dict(model="smollm2-135m", prompt="Once upon a time", max_tokens=8, temperature=0.9, top_p=0.9, seed=7)
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def test_stop_cutter_holds_back_a_split_stop_string():
    from host.daemon.stops import StopCutter

    cut = StopCutter(["END", "xyz"])
    assert cut.push("abc E") == ("abc ", False)  # "E" may begin END
    assert cut.push("N") == ("", False)
    assert cut.push("Dless") == ("", True)  # cut before END
    cut = StopCutter(["END"])
    assert cut.push("abc EN") == ("abc ", False)
    assert cut.push("d") == ("ENd", False)
    assert cut.push("E") == ("", False) and cut.flush() == "E"


# ---- errors ---------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("best_of", 2),
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]), ("tool_choice", "required"),
])
def test_fields_not_honoured_are_refused_not_ignored(http, field, value):
    """Issue 40: each was answered 200 as if it had not been sent."""
    # tools: chat completions take them (test_daemon_tools.py), the legacy completions do not
    route, body = ("/v1/completions", {"prompt": "Hi"}) if field in ("best_of", "tools", "tool_choice") else \
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})
    err = _error(http.post(route, json={"model": "smollm2-135m", "max_tokens": 1, field: value, **body}), 400)
    assert err["param"] == field and err["code"] == "unsupported_value" and "not supported" in err["message"]


def test_neutral_values_of_fields_not_honoured_are_served(http):
    """What clients send by default (the openai client's, LangChain's) asks for nothing: served."""
    neutral = {"presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "logit_bias": {},
               "top_k": -1, "min_p": 0, "logprobs": False, "top_logprobs": 0, "tools": [], "tool_choice": "none"}
    resp = http.post("/v1/chat/completions", json={"model": "smollm2-135m", "max_tokens": 1, **neutral,
                                                   "messages": [{"role": "user", "content": "Hi"}]})
    assert resp.status_code == 200, resp.text
    resp = http.post("/v1/completions", json={"model": "smollm2-135m", "max_tokens": 1, "prompt": "Hi", "echo": False,
                                              "best_of": 1, "suffix": None, "user": "someone"})
    assert resp.status_code == 200, resp.text


def test_bad_api_key(served, http):
    bad = openai.OpenAI(base_url=served.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    # no key at all, with a body that is not even JSON: refused before the body is read
    resp = httpx.post(served.url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert _error(resp, 401)["code"] == "invalid_api_key"
    assert http.get("/v1/models", headers={"Authorization": "Bearer another-key"}).status_code == 200


def test_unknown_model(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="Hi", max_tokens=1)
    assert e.value.code == "model_not_found" and e.value.param == "model"


def test_malformed_and_invalid_bodies(http):
    err = _error(http.post("/v1/chat/completions", content=b'{"model": "smollm2-135m", "messages": [',
                           headers={"content-type": "application/json"}), 400)
    assert err["code"] == "invalid_json"
    err = _error(http.post("/v1/completions", json={"model": "smollm2-135m", "prompt": "Hi", "max_tokens": -1}), 400)
    assert err["param"] == "max_tokens"
    err = _error(http.post("/v1/chat/completions", json={"model": "smollm2-135m"}), 400)
    assert err["param"] == "messages"
    err = _error(http.post("/v1/completions", json={"model": "smollm2-135m", "prompt": "Hi",
                                                    "max_tokens": 10**6}), 400)
    assert err["code"] == "context_length_exceeded"
    _error(http.get("/v1/nothing-here"), 404)
    _error(http.get("/v1/completions"), 405)


def test_null_fields_take_their_defaults(http):
    resp = http.post("/v1/completions", json={"model": "smollm2-135m", "prompt": "Hi", "max_tokens": 1, "n": None,
                                              "temperature": None, "top_p": None, "stop": None, "stream": None})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 1


# ---- instances: admission, disconnects, metrics ----------------------------------------------

def _open_long_stream(http):
    """A streaming request that is generating: its first text chunk has arrived."""
    cm = http.stream("POST", "/v1/chat/completions", json={
        "model": "smollm2-135m", "messages": [{"role": "user", "content": LONG}], "max_tokens": 2000,
        "temperature": 0, "stream": True})
    resp = cm.__enter__()
    assert resp.status_code == 200
    lines = resp.iter_lines()
    for line in lines:
        if line.startswith("data: ") and '"content": "' in line and '"content": ""' not in line:
            break
    return cm, lines


def test_busy_then_disconnect_cancels(served, http, client):
    """max_instances=1 and no queue: a second request while one generates gets 429 with
    Retry-After; closing the stream cancels its instance, which frees its pages and its slot."""
    pool = served.service.engine.pool
    used = pool.used_pages
    cm, _ = _open_long_stream(http)
    try:
        resp = http.post("/v1/completions", json={"model": "smollm2-135m", "prompt": "Hi", "max_tokens": 1})
        err = _error(resp, 429)
        assert err["code"] == "rate_limit_exceeded" and resp.headers["retry-after"] == "1"
        with pytest.raises(openai.RateLimitError):  # what the openai client retries by itself
            client.completions.create(model="smollm2-135m", prompt="Hi", max_tokens=1)
    finally:
        cm.__exit__(None, None, None)  # the client goes away mid-stream
    served.wait_idle()
    result = served.started[-1].result()
    assert result.error == "cancelled: the client went away"
    assert len(result.token_ids) < 2000
    assert pool.used_pages == used
    assert http.post("/v1/completions", json={"model": "smollm2-135m", "prompt": "Hi", "max_tokens": 1}).status_code == 200


def test_metrics_count(client, http):
    before = _metrics(http)
    out = client.completions.create(model="smollm2-135m", prompt="Hello", max_tokens=3, temperature=0)
    http.post("/v1/completions", json={"model": "nope", "prompt": "Hi"})
    after = _metrics(http)
    assert _requests(after, "/v1/completions", 200) == _requests(before, "/v1/completions", 200) + 1
    assert _requests(after, "/v1/completions", 404) == _requests(before, "/v1/completions", 404) + 1
    labels = (("inferlet", "text-completion"), ("model_name", "smollm2-135m"))
    gen = ("pie:generation_tokens_total", labels)
    assert after[gen] == before.get(gen, 0) + out.usage.completion_tokens
    prompt = ("pie:prompt_tokens_total", labels)
    assert after[prompt] == before.get(prompt, 0) + out.usage.prompt_tokens
    assert after[("pie:num_requests_running", (("model_name", "smollm2-135m"),))] == 0


def test_stop_cancels_running_streams(runtime, text_completion_wasm):
    """Shutting down (what SIGINT/SIGTERM do) cancels running instances: their streams end with
    the error and [DONE], the daemon stops, and the pages are back."""
    s = Served(runtime, text_completion_wasm, max_instances=2)
    used = runtime.engine.pool.used_pages
    with httpx.Client(base_url=s.url, timeout=120) as http:
        cm, lines = _open_long_stream(http)
        s.daemon.stop()
        rest = list(lines)
        cm.__exit__(None, None, None)
    s.thread.join(30)
    assert not s.thread.is_alive()
    events = [line[len("data: "):] for line in rest if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["message"] == "cancelled: the server is shutting down"
    assert s.started[0].result().error == "cancelled: the server is shutting down"
    assert runtime.engine.pool.used_pages == used


def test_pie_serve_command_stops_on_sigterm(tmp_path, text_completion_wasm):
    """The real command: flags parsed, the model loaded, a key file read; SIGTERM mid-stream
    cancels the instance, ends the stream with [DONE] and exits 0."""
    import signal
    import subprocess
    import sys

    keys = tmp_path / "keys"
    keys.write_text("# a comment\nk1\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "host.cli", "serve", "--port", str(port), "--dtype", "float32",
                             "--device", "cpu", "--api-key-file", str(keys), "--max-instances", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "pie serve did not start"
            try:
                httpx.get(url + "/metrics")
                break
            except httpx.TransportError:
                time.sleep(0.2)
        with httpx.Client(base_url=url, headers={"Authorization": "Bearer k1"}, timeout=120) as http:
            assert http.get("/v1/models").status_code == 200
            cm, lines = _open_long_stream(http)
            proc.send_signal(signal.SIGTERM)
            rest = list(lines)
            cm.__exit__(None, None, None)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = proc.stdout.read()
    events = [line[len("data: "):] for line in rest if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "cancelled: the server is shutting down" in events[-2]
    assert "GET /v1/models 200" in out and "cancelled 1 running instance" in out and "0 KV pages in use" in out

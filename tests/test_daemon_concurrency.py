"""`pie serve` under load: many streaming clients at once, clients killed mid-stream, bursts past
--max-instances (queued, then 429), per-key limits and ownership of instances (test_daemon.py's Served)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from conftest import dev_prompts
from test_daemon import LONG, Served
from wasm_fixtures import *  # noqa: F401,F403

pytestmark = [pytest.mark.model, pytest.mark.wasm]

KEY_A, KEY_B = "key-a", "key-b"
N_CLIENTS = 16
N_PROMPTS = 8  # each asked by two of the clients: half the cost of the texts run alone
MAX_TOKENS = 10  # short answers: the test is about who gets which text, not about speed


def _chat(prompt: str, max_tokens: int, stream: bool = True) -> dict:
    return {"model": "smollm2-135m", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": stream}


def _stream_text(lines) -> str:
    """The content of a chat SSE stream, checked to end with [DONE] and no error event."""
    text, done = [], False
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            done = True
            break
        chunk = json.loads(data)
        assert "error" not in chunk, chunk
        text += [c["delta"].get("content") or "" for c in chunk["choices"]]
    assert done
    return "".join(text)


def _headers(key: str | None) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


def _open_stream(url: str, body: dict, key: str | None = None):
    """(client, response context, lines, first text) of a streaming chat whose first content has arrived."""
    http = httpx.Client(base_url=url, headers=_headers(key), timeout=120)
    cm = http.stream("POST", "/v1/chat/completions", json=body)
    resp = cm.__enter__()
    assert resp.status_code == 200, resp.read()
    lines = resp.iter_lines()
    for line in lines:
        if line.startswith("data: ") and '"content": "' in line and '"content": ""' not in line:
            return http, cm, lines, json.loads(line[len("data: "):])["choices"][0]["delta"]["content"]
    raise AssertionError("the stream ended before its first text")


def _close(http, cm) -> None:
    cm.__exit__(None, None, None)  # the client goes away mid-stream
    http.close()


def _wait(cond, what: str) -> None:
    """Until cond() holds; a liveness guard, not a speed assertion."""
    deadline = time.monotonic() + 60
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


# ---- admission alone (no model): the queue's order and the paths a race takes ----------------

def test_admission_queues_in_order_and_bounds_keys():
    import asyncio

    from host.daemon.admission import Admission
    from host.daemon.errors import Busy, TooManyRequests

    async def main():
        adm = Admission(slots=1, queue=2, per_key=2)
        await adm.acquire("a")
        b = asyncio.ensure_future(adm.acquire("b"))
        c = asyncio.ensure_future(adm.acquire("a"))
        await asyncio.sleep(0)
        assert (adm.running, adm.waiting) == (1, 2)
        with pytest.raises(TooManyRequests) as e:  # key "a": one running, one waiting
            await adm.acquire("a")
        assert e.value.code == "key_limit_reached" and e.value.headers == {"Retry-After": "1"}
        with pytest.raises(TooManyRequests) as e:  # no place left in the queue
            await adm.acquire("d")
        assert e.value.code == "rate_limit_exceeded"
        await asyncio.to_thread(adm.release, "a")  # freed from another thread, as an instance's waiter does
        await b
        assert not c.done() and (adm.running, adm.waiting) == (1, 1)
        # a waiter granted a slot as its client went away gives the slot back
        adm.release("b")
        c.cancel()
        with pytest.raises(asyncio.CancelledError):
            await c
        assert (adm.running, adm.waiting) == (0, 0)
        await adm.acquire("a")
        d = asyncio.ensure_future(adm.acquire("d"))
        await asyncio.sleep(0)
        adm.close()
        with pytest.raises(Busy):
            await d
        with pytest.raises(Busy):
            await adm.acquire("e")
    asyncio.run(main())


def _alone(runtime, wasm, prompt: str, max_tokens: int) -> str:
    res = runtime.run(wasm, ["--prompt", prompt, "--chat", "--max-tokens", str(max_tokens)])
    assert res.ok, res.error
    return res.text


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    return [p["prompt"] for p in dev_prompts()[:N_PROMPTS]]


@pytest.fixture(scope="module")
def alone(runtime, text_completion_wasm, prompts) -> list[str]:
    """Each prompt's greedy text run alone, one after another."""
    return [_alone(runtime, text_completion_wasm, p, MAX_TOKENS) for p in prompts]


def test_16_concurrent_streams_each_get_their_own_text(runtime, text_completion_wasm, prompts, alone):
    s = Served(runtime, text_completion_wasm, max_instances=N_CLIENTS, max_queue=0)
    pool = runtime.engine.pool
    free = pool.free_pages
    got: dict[int, str] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(N_CLIENTS)

    def client(i: int) -> None:
        try:
            with httpx.Client(base_url=s.url, timeout=300) as http:
                start.wait()
                body = _chat(prompts[i % N_PROMPTS], MAX_TOKENS)
                with http.stream("POST", "/v1/chat/completions", json=body) as resp:
                    assert resp.status_code == 200, resp.read()
                    got[i] = _stream_text(resp.iter_lines())
        except BaseException as e:  # reported below, with the others' results
            errors.append(e)
    try:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(N_CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not errors, errors
        assert [got[i] for i in range(N_CLIENTS)] == [alone[i % N_PROMPTS] for i in range(N_CLIENTS)]
        assert len(set(alone)) == N_PROMPTS  # the prompts' answers differ: a mix-up would show
        assert len(s.started) == N_CLIENTS and all(h.result().ok for h in s.started)
        s.wait_idle()
        assert pool.free_pages == free
    finally:
        s.stop()


def test_killed_clients_leave_the_page_pool_as_it_was(runtime, text_completion_wasm, prompts, alone):
    """Four clients go away mid-stream while four others run to their end beside them."""
    s = Served(runtime, text_completion_wasm, max_instances=8, max_queue=0)
    pool = runtime.engine.pool
    free = pool.free_pages
    try:
        killed = [_open_stream(s.url, _chat(f"{LONG} Number {i}.", 2000)) for i in range(4)]
        survivors = [_open_stream(s.url, _chat(prompts[i], MAX_TOKENS)) for i in range(4)]
        assert pool.free_pages < free
        for http, cm, *_ in killed:
            _close(http, cm)
        for i, (http, cm, lines, first) in enumerate(survivors):
            text = first + _stream_text(lines)
            _close(http, cm)
            assert text == alone[i]
        s.wait_idle()
        results = [h.result() for h in s.started]
        assert [r.error for r in results[:4]] == ["cancelled: the client went away"] * 4, [r.log[-3000:] for r in results[:4]]
        assert all(r.ok for r in results[4:]) and [r.text for r in results[4:]] == alone[:4]
        assert pool.free_pages == free
    finally:
        s.stop()


@pytest.fixture
def burst(runtime, text_completion_wasm):
    """Two slots, two queue places; two slot holders generating long answers."""
    s = Served(runtime, text_completion_wasm, max_instances=2, max_queue=2)
    holders = [_open_stream(s.url, _chat(f"{LONG} Number {i}.", 2000)) for i in range(2)]
    try:
        yield s, holders
    finally:
        for http, cm, *_ in holders:
            if not http.is_closed:
                _close(http, cm)
        s.stop()


def _metric(url: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics").text
    return sum(x.value for fam in text_string_to_metric_families(text) for x in fam.samples if x.name == name)


def test_a_burst_is_queued_then_refused_with_429(burst, prompts, alone):
    s, holders = burst
    adm = s.service.admission
    answers: dict[int, httpx.Response] = {}

    def queued(i: int) -> None:
        answers[i] = httpx.post(s.url + "/v1/chat/completions", json=_chat(prompts[i], MAX_TOKENS, stream=False),
                                timeout=300)
    threads = [threading.Thread(target=queued, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    _wait(lambda: adm.waiting == 2, "the two requests past the slots did not queue")
    assert _metric(s.url, "pie:num_requests_waiting") == 2 and _metric(s.url, "pie:num_requests_running") == 2
    health = httpx.get(s.url + "/health")
    assert health.status_code == 200 and (health.json()["status"], health.json()["running"],
                                          health.json()["waiting"]) == ("ok", 2, 2)
    # the fifth: no slot, no place in the queue
    resp = httpx.post(s.url + "/v1/chat/completions", json=_chat(prompts[2], MAX_TOKENS, stream=False))
    assert resp.status_code == 429 and int(resp.headers["retry-after"]) >= 1
    assert resp.json()["error"]["code"] == "rate_limit_exceeded"
    assert all(t.is_alive() for t in threads) and adm.waiting == 2  # still waiting, not dropped
    for http, cm, *_ in holders:
        _close(http, cm)
    for t in threads:
        t.join(300)
    assert [answers[i].status_code for i in range(2)] == [200, 200]
    assert [answers[i].json()["choices"][0]["message"]["content"] for i in range(2)] == alone[:2]
    assert len(s.started) == 4 and adm.waiting == 0


def test_a_queued_client_that_goes_away_leaves_the_queue(burst):
    s, _ = burst
    adm = s.service.admission
    with pytest.raises(httpx.ReadTimeout):  # queued behind the holders until the client gives up
        httpx.post(s.url + "/v1/chat/completions", json=_chat("Hi", 4), timeout=httpx.Timeout(60, read=1))
    _wait(lambda: adm.waiting == 0, "the request stayed queued after its client went away")
    assert len(s.started) == 2 and adm.running == 2


def test_shutdown_refuses_the_queued_requests(burst):
    s, _ = burst
    answer: list[httpx.Response] = []
    t = threading.Thread(target=lambda: answer.append(
        httpx.post(s.url + "/v1/chat/completions", json=_chat("Hi", 4, stream=False), timeout=120)))
    t.start()
    _wait(lambda: s.service.admission.waiting == 1, "the request did not queue")
    assert s.service.instances.close() == 2  # what SIGINT/SIGTERM do first: the holders are cancelled
    t.join(120)
    assert answer[0].status_code == 503 and answer[0].json()["error"]["code"] == "shutting_down"
    assert len(s.started) == 2


def test_per_key_limit_and_instances_owned_by_their_key(runtime, text_completion_wasm):
    s = Served(runtime, text_completion_wasm, max_instances=4, max_queue=4, max_instances_per_key=1,
               api_keys=[KEY_A, KEY_B])
    a = httpx.Client(base_url=s.url, headers=_headers(KEY_A), timeout=120)
    b = httpx.Client(base_url=s.url, headers=_headers(KEY_B), timeout=120)
    try:
        http, cm, *_ = _open_stream(s.url, _chat(LONG, 2000), KEY_A)
        resp = a.post("/v1/chat/completions", json=_chat("Hi", 1, stream=False))
        assert resp.status_code == 429 and resp.json()["error"]["code"] == "key_limit_reached"
        assert "retry-after" in resp.headers
        assert b.post("/v1/chat/completions", json=_chat("Hi", 1, stream=False)).status_code == 200
        _close(http, cm)
        s.wait_idle()

        run = a.post("/v1/instances", json={"inferlet": "text-completion", "detach": True,
                                            "args": ["--prompt", LONG, "--chat", "--max-tokens", "2000"]}).json()
        rid = run["id"]
        assert [r["id"] for r in a.get("/v1/instances").json()["data"]] == [rid]
        assert b.get("/v1/instances").json()["data"] == []
        for resp in (b.get(f"/v1/instances/{rid}"), b.get(f"/v1/instances/{rid}/events"),
                     b.post(f"/v1/instances/{rid}/cancel")):
            assert resp.status_code == 404 and resp.json()["error"]["code"] == "instance_not_found"
        assert a.get(f"/v1/instances/{rid}").json()["status"] == "running"
        assert a.post(f"/v1/instances/{rid}/cancel").status_code == 200
        s.wait_idle()
        assert a.get(f"/v1/instances/{rid}").json()["status"] == "cancelled"
    finally:
        a.close()
        b.close()
        s.stop()


def test_the_openai_client_retries_a_429_until_served(burst, prompts, alone):
    """OpenAI's client honours Retry-After: a burst past slots and queue is served in the end."""
    s, holders = burst
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=8, timeout=300)
    out: dict[int, str] = {}

    def ask(i: int) -> None:
        r = client.chat.completions.create(model="smollm2-135m", temperature=0, max_tokens=MAX_TOKENS,
                                           messages=[{"role": "user", "content": prompts[i]}])
        out[i] = r.choices[0].message.content
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]  # one more than the queue takes
    for t in threads:
        t.start()
    _wait(lambda: s.service.admission.waiting == 2, "the burst did not queue")
    for http, cm, *_ in holders:
        _close(http, cm)
    for t in threads:
        t.join(300)
    assert [out.get(i) for i in range(3)] == alone[:3]

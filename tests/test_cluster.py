"""`pie serve --replicas`: the server as a Ray Serve deployment of two replicas over the suite's
tiny model, on a local Ray cluster the `deployment` fixture starts in a process of its own
(tests/cluster_deployment.py; logical CPUs, half a CPU and one torch thread a replica) and shuts
down; compared with one server in this process on the same model."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytest.importorskip("ray.serve")

from host.conformance.models import suite_engine  # noqa: E402
from host.daemon.limits import ServeLimits  # noqa: E402
from host.daemon.service import ServeConfig  # noqa: E402
from test_conformance_daemon import run as conformance  # noqa: E402
from test_daemon import KEY, Served  # noqa: E402
from wasm_fixtures import TEST_CACHE, build_inferlet  # noqa: E402

pytestmark = [pytest.mark.wasm]

OTHER = "another-key"
PROMPTS = ["The sky is", "Once upon a time", "def f(x):", "1, 2, 3,"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def config(uploads) -> ServeConfig:
    """The server's settings, the deployment's replicas' and the in-process reference's alike."""
    wasm = build_inferlet("text-completion")
    # four instances at once (the conformance suite's batched cases), each key may take the
    # tiny model's whole pool (32 pages of 4 rows: four of PROMPTS' completions)
    return ServeConfig(inferlet=wasm, max_instances=4, max_queue=16, api_keys=[KEY, OTHER],
                       builtin_dir=wasm.parent, upload_dir=uploads, limits=ServeLimits(kv_share_per_key=1.0))


@pytest.fixture(scope="module")
def uploads(tmp_path_factory) -> Path:
    """The replicas' upload folder (one machine: one folder, a cache of the shelf)."""
    return tmp_path_factory.mktemp("uploads")


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, uploads):
    """The deployment in a process of its own (tests/cluster_deployment.py: ray.init's signal
    handlers would take this process's wasmtime traps), until SIGTERM shuts it down."""
    port = _free_port()
    log = tmp_path_factory.mktemp("deployment") / "log.txt"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, str(Path(__file__).parent / "cluster_deployment.py"), str(port),
                                 str(uploads)], stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while "ready" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        _wait_for_replicas(url, 2)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """One server in this process on the same model: the answers the deployment must give."""
    from host.runtime import Runtime

    with Runtime(suite_engine("tiny"), cache_dir=TEST_CACHE) as rt:
        settings = vars(config(tmp_path_factory.mktemp("uploads-single")))
        s = Served(rt, settings.pop("inferlet"), **settings)
        yield s
        s.stop()


def _http(url, key=KEY) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=120)


def _health(url) -> dict:
    return httpx.get(url + "/health", timeout=30).json()


def _wait_for_replicas(url, n, timeout=120, without: str | None = None) -> dict:
    """/health once `n` replicas (and not `without`) have posted to the board."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            h = _health(url)
            if h.get("replicas") == n and h["status"] == "ok" and without not in h["by_replica"]:
                return h
        except (httpx.HTTPError, ValueError):
            pass
        assert time.monotonic() < deadline, "the deployment's replicas did not all report"
        time.sleep(0.5)


def _counts(url, endpoint: str) -> dict[str, float]:
    """Requests answered 200 on `endpoint`, by replica (the deployment's /metrics)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "pie:http_requests_total" and s.labels.get("endpoint") == endpoint \
                    and s.labels.get("status") == "200":
                out[s.labels["replica"]] = out.get(s.labels["replica"], 0) + s.value
    return out


def _complete(url, prompt, **kw):
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    return client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, **kw)


def test_greedy_answers_equal_one_servers(deployment, single):
    for p in PROMPTS:
        assert _complete(deployment, p).choices[0].text == _complete(single.url, p).choices[0].text


def test_health_reports_the_deployment(deployment):
    h = _wait_for_replicas(deployment, 2)
    assert h["model"] == "tiny" and h["replica"] in h["by_replica"]
    assert h["running"] == sum(r["running"] for r in h["by_replica"].values())
    assert all(r["pid"] > 0 for r in h["by_replica"].values())


def test_concurrent_requests_spread_over_both_replicas(deployment):
    from host.cluster.board import REPORT_S

    time.sleep(2.5 * REPORT_S)  # every replica's last post counts the requests before
    before = _counts(deployment, "/v1/completions")

    def one(i):
        client = openai.OpenAI(base_url=deployment + "/v1", api_key=KEY, max_retries=0, timeout=120)
        raw = client.completions.with_raw_response.create(model="tiny", prompt=PROMPTS[i % 4], max_tokens=12,
                                                           temperature=0, user=f"user{i}")  # 16 affinity keys
        return raw.parse().choices[0].text, raw.headers["x-pie-replica"]

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(one, range(16)))
    texts = [t for t, _ in answers]
    assert texts == [texts[i % 4] for i in range(16)]  # greedy: whichever replica answered
    by_header = {r: sum(1 for _, x in answers if x == r) for _, r in answers}
    assert len(by_header) == 2, f"one replica took every request: {by_header}"
    deadline = time.monotonic() + 10
    while True:  # the board hears from each replica once a REPORT_S
        after = _counts(deployment, "/v1/completions")
        served = {r: after[r] - before.get(r, 0) for r in after if after[r] > before.get(r, 0)}
        if served == by_header or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert served == by_header


def test_a_conversations_turns_stay_on_its_replica(deployment):
    """Prefix affinity: each turn to the replica its conversation's key names (the requests one at
    a time, so no queue is past the slack)."""
    import json

    from host.cluster.proxy import affinity_key
    from host.cluster.router import affine

    ids = sorted(_wait_for_replicas(deployment, 2)["by_replica"])
    with _http(deployment) as http:
        for c in range(8):  # token ids (the tiny model has no chat template, and its pool is small)
            prompt = [5 + (c + i) % 40 for i in range(18)]  # a key of the first 16 ids
            for turn in range(3):
                body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}
                resp = http.post("/v1/completions", json=body)
                assert resp.status_code == 200, resp.text
                assert resp.json()["choices"][0].get("limit") is None, resp.text
                assert resp.headers["x-pie-replica"] == affine(affinity_key(json.dumps(body).encode()), ids)
                prompt = prompt + [7 + turn, 9]


def test_instances_stay_on_their_replica(deployment):
    """Launch, get, attach and cancel, across replicas: each instance's calls reach its replica;
    another key's calls are 404 wherever they land."""
    with _http(deployment) as http, _http(deployment, OTHER) as other:
        runs = []
        for _ in range(8):
            resp = http.post("/v1/instances", json={"inferlet": "text-completion", "detach": True,
                                                    "args": ["--prompt", "Once", "--max-tokens", "20"]})
            assert resp.status_code == 201, resp.text
            runs.append(resp.json()["id"])
        replicas = {r.split(".")[0].removeprefix("inst_") for r in runs}
        assert len(replicas) == 2, f"every launch went to one replica: {runs}"
        for run_id in runs:
            for _ in range(3):
                assert http.get(f"/v1/instances/{run_id}").json()["id"] == run_id
            assert other.get(f"/v1/instances/{run_id}").status_code == 404
            assert other.post(f"/v1/instances/{run_id}/cancel").status_code == 404
        for run_id in runs:
            assert _last_event(http, run_id) == "return"
        endless = {}  # an instance that runs until cancelled, on each replica
        while len(endless) < 2:
            resp = http.post("/v1/instances", json={"inferlet": _upload(http, "misbehave"), "args": ["--mode", "endless-loop"]})
            assert resp.status_code == 201, resp.text
            run_id, replica = resp.json()["id"], resp.headers["x-pie-replica"]
            if replica in endless:  # its replica has one already: this one goes at once (each holds a slot)
                assert http.post(f"/v1/instances/{run_id}/cancel").status_code == 200
            else:
                endless[replica] = run_id
        for run_id in endless.values():
            card = http.get(f"/v1/instances/{run_id}").json()
            assert card["status"] == "running", card.get("error")
            resp = http.post(f"/v1/instances/{run_id}/cancel")
            assert resp.status_code == 200 and resp.json()["id"] == run_id, resp.text
            assert _last_event(http, run_id) == "error"
            assert http.get(f"/v1/instances/{run_id}").json()["status"] == "cancelled"
        gone = "inst_zzzzzzzz." + "0" * 24  # a replica that is not in the deployment
        assert http.get(f"/v1/instances/{gone}").status_code == 404


def _last_event(http, run_id) -> str:
    with http.stream("GET", f"/v1/instances/{run_id}/events") as resp:
        assert resp.status_code == 200 and resp.headers["x-pie-replica"] in run_id
        return [ln.removeprefix("event: ") for ln in resp.iter_lines() if ln.startswith("event:")][-1]


def _upload(http, test_inferlet: str) -> str:
    from wasm_fixtures import build_test_inferlet

    resp = http.post("/v1/inferlets", content=build_test_inferlet(test_inferlet).read_bytes())
    assert resp.status_code in (200, 201), resp.text
    return resp.json()["hash"]


def test_an_upload_reaches_every_replica(deployment, uploads):
    wasm = build_inferlet("text-completion").read_bytes()
    with _http(deployment) as http:
        resp = http.post("/v1/inferlets?name=mine", content=wasm)
        assert resp.status_code in (200, 201), resp.text
        digest = resp.json()["hash"]
        for f in [f for f in uploads.rglob("*") if f.is_file()]:  # as on machines that never saw it:
            f.unlink()  # only the shelf (Ray's object store) holds the upload now
        seen = set()
        for _ in range(8):
            resp = http.post("/v1/instances", json={"inferlet": "mine", "args": ["--prompt", "a", "--max-tokens", "2"]})
            assert resp.status_code == 201, resp.text
            seen.add(resp.headers["x-pie-replica"])
        assert len(seen) == 2
        assert (uploads / f"{digest}.wasm").read_bytes() == wasm  # installed from the shelf on first use
        assert [p["name"] for p in http.get("/v1/inferlets").json()["data"] if p["hash"] == digest and not p["builtin"]] == ["mine"]


def test_conformance_suite_passes_against_the_deployment(deployment, tmp_path):
    rc, lines, err = conformance("--server", deployment, "--api-key", KEY, "--json", tmp_path / "r.json")
    print(lines[-1])
    assert rc == 0, "\n".join(lines) + err


def test_a_replica_killed_mid_stream_ends_the_stream_with_an_error(deployment):
    """An attached client of an instance whose replica dies gets an error event, never a hang nor
    a cut; the deployment answers the next requests, and Ray Serve starts a replica in its place."""
    with _http(deployment) as http:
        resp = http.post("/v1/instances", json={"inferlet": _upload(http, "misbehave"), "args": ["--mode", "endless-loop"]})
        assert resp.status_code == 201, resp.text
        run_id, victim = resp.json()["id"], resp.headers["x-pie-replica"]
        pid = _health(deployment)["by_replica"][victim]["pid"]
        with http.stream("GET", f"/v1/instances/{run_id}/events") as resp:
            lines = resp.iter_lines()
            assert next(ln for ln in lines if ln.startswith("data:")) == 'data: {"text": "looping"}'
            os.kill(pid, signal.SIGKILL)
            rest = list(lines)
        assert "event: error" in rest and '"replica_failed"' in rest[rest.index("event: error") + 1], rest
        for p in PROMPTS:  # the replica left, or the new one
            assert _complete(deployment, p).choices[0].text
        assert http.get(f"/v1/instances/{run_id}").status_code == 404  # its replica is gone
    _wait_for_replicas(deployment, 2, timeout=180, without=victim)


# The proxy's middleware alone, on a fake proxy app: what a client sees when a replica dies.
def _through_proxy(app, path):
    import asyncio

    from host.cluster.proxy import EndCutStreams

    sent = []

    async def send(m):
        sent.append(m)

    async def receive():
        return {"type": "http.disconnect"}

    asyncio.run(EndCutStreams(app)({"type": "http", "path": path, "method": "POST"}, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    assert sent[-1]["type"] == "http.response.body" and not sent[-1].get("more_body")
    return start["status"], body.decode()


async def _cut_stream(scope, receive, send):  # the proxy after its replica died mid-stream
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    await send({"type": "http.response.body", "body": b'data: {"choices": []}\n\n', "more_body": True})


async def _proxy_500(scope, receive, send):  # the proxy when the replica died before answering
    await send({"type": "http.response.start", "status": 500, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"Internal Server Error"})


def test_a_cut_openai_stream_ends_with_an_error_chunk_and_done():
    import json

    status, body = _through_proxy(_cut_stream, "/v1/completions")
    events = [e.removeprefix("data: ") for e in body.split("\n\n") if e]
    assert status == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "replica_failed"


def test_a_cut_instance_stream_ends_with_an_error_event():
    status, body = _through_proxy(_cut_stream, "/v1/instances/inst_abc.00/events")
    assert body.endswith("\n\n") and "event: error\ndata: " in body and "replica_failed" in body


def test_the_proxys_plain_errors_are_in_openais_shape():
    import json

    status, body = _through_proxy(_proxy_500, "/v1/completions")
    assert status == 500 and json.loads(body)["error"]["code"] == "replica_failed"


# Prefix affinity: the proxy's conversation key and the router's choice, without Ray's processes.
def _chat(*turns, **kw) -> bytes:
    import json

    msgs = [{"role": "system", "content": "Be brief."}]
    for i, t in enumerate(turns):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": t})
    return json.dumps({"model": "tiny", "messages": msgs, **kw}).encode()


def test_a_conversations_turns_share_its_key():
    import json

    from host.cluster.proxy import PREFIX_CHARS, affinity_key

    first = affinity_key(_chat("What is a cat?"))
    assert first is not None and affinity_key(_chat("What is a cat?", "An animal.", "And a dog?")) == first
    assert affinity_key(_chat("What is a dog?")) != first
    assert affinity_key(_chat("What is a cat?", user="u1")) == affinity_key(_chat("Hello", user="u1")) != first
    long = "x" * PREFIX_CHARS
    assert affinity_key(json.dumps({"model": "tiny", "prompt": long}).encode()) == \
        affinity_key(json.dumps({"model": "tiny", "prompt": long + " and more", "max_tokens": 3}).encode())
    assert affinity_key(json.dumps({"prompt": [[1, 2, 3]]}).encode()) == affinity_key(json.dumps({"prompt": [1, 2, 3]}).encode())
    for bad in (b"{", b"[1]", b'{"model": "tiny"}', b""):
        assert affinity_key(bad) is None


def test_the_proxy_passes_a_completions_body_on_with_its_key():
    import asyncio

    from host.cluster.proxy import EndCutStreams, _session_header, affinity_key
    from host.cluster.router import AFFINE

    body = _chat("What is a cat?")
    seen = {}

    async def app(scope, receive, send):
        got = b""
        while True:
            m = await receive()
            got += m.get("body", b"")
            if not m.get("more_body"):
                break
        seen["body"], seen["headers"] = got, dict(scope["headers"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    parts = [{"type": "http.request", "body": body[:10], "more_body": True},
             {"type": "http.request", "body": body[10:], "more_body": False}]

    async def receive():
        return parts.pop(0)

    async def send(m):
        pass

    scope = {"type": "http", "path": "/v1/chat/completions", "method": "POST",
             "headers": [(_session_header(), b"pie-pin:someone-elses")]}  # a client's own session id is dropped
    asyncio.run(EndCutStreams(app)(scope, receive, send))
    assert seen["body"] == body
    assert seen["headers"][_session_header()] == (AFFINE + affinity_key(body)).encode()


class _Replica:
    def __init__(self, rid):
        from collections import namedtuple

        self.replica_id = namedtuple("ReplicaID", "unique_id")(rid)


def _router(lens: dict, slack=2, affinity=True):
    from host.cluster.router import PinnedRouter

    router = PinnedRouter.__new__(PinnedRouter)  # its choice alone: none of Ray's routing state
    router.initialize_state(affinity=affinity, slack=slack)
    router._use_replica_queue_len_cache = False

    async def probe(replicas, backoff):
        return [(r, lens.get(r.replica_id.unique_id)) for r in replicas]

    router._probe_queue_lens = probe
    return router


def _choose(router, replicas, session):
    import asyncio
    from types import SimpleNamespace

    req = SimpleNamespace(metadata=SimpleNamespace(session_id=session))
    ranks = asyncio.run(router.choose_replicas(replicas, req))
    return [[r.replica_id.unique_id for r in rank] for rank in ranks]


def test_the_router_sends_a_key_to_its_replica_while_the_load_allows():
    from host.cluster.router import AFFINE, PIN, affine

    ids = ["r1", "r2", "r3"]
    replicas = [_Replica(i) for i in ids]
    keys = [f"k{i}" for i in range(60)]
    owners = {k: affine(k, ids) for k in keys}
    assert set(owners.values()) == set(ids)  # the keys spread
    assert all(affine(k, ids[:2]) == owners[k] for k in keys if owners[k] != "r3")  # r3 gone: only its keys move
    for k in keys[:10]:
        want = owners[k]
        assert _choose(_router({i: 0 for i in ids}), replicas, AFFINE + k)[0] == [want]
        assert _choose(_router({i: 2 if i == want else 0 for i in ids}), replicas, AFFINE + k)[0] == [want]
        ranks = _choose(_router({i: 3 if i == want else 0 for i in ids}), replicas, AFFINE + k)
        assert len(ranks) == 1 and len(ranks[0]) == 2  # too far behind: power of two choices
        assert len(_choose(_router({i: 0 for i in ids}, affinity=False), replicas, AFFINE + k)[0]) == 2
        assert len(_choose(_router({i: 0 for i in ids if i != want}), replicas, AFFINE + k)[0]) == 2  # no answer
    assert _choose(_router({}), replicas, PIN + "r2") == [["r2"]]

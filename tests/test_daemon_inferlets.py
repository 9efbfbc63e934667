"""`pie serve`'s inferlet API (/v1/inferlets, /v1/instances) and `pie run --server`, with real
httpx against a daemon on a free loopback port (test_daemon.py's Served)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import httpx
import pytest

from host.errors import PieError
from test_daemon import KEY, LONG, Served
from wasm_fixtures import *  # noqa: F401,F403

pytestmark = [pytest.mark.model, pytest.mark.wasm]

UPLOAD_LIMIT = 24 << 20  # above text-completion.wasm (~18 MiB)
GREEDY = ["--prompt", "Why is the sky blue?", "--chat", "--max-tokens", "10"]


@pytest.fixture(scope="module")
def served(runtime, text_completion_wasm, tmp_path_factory):
    s = Served(runtime, text_completion_wasm, max_instances=1, max_queue=0, api_keys=[KEY],
               builtin_dir=text_completion_wasm.parent, upload_dir=tmp_path_factory.mktemp("uploads"),
               max_upload_bytes=UPLOAD_LIMIT)
    yield s
    s.stop()


@pytest.fixture
def http(served):
    with httpx.Client(base_url=served.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def reference(runtime, text_completion_wasm):
    res = runtime.run(text_completion_wasm, GREEDY, name="text-completion")
    assert res.ok, res.error
    return res


def _error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    return resp.json()["error"]


def _events(lines) -> list[tuple[str, dict]]:
    from host.daemon.client import sse_events

    return list(sse_events(lines))


def _launch(http, args, **kw) -> dict:
    resp = http.post("/v1/instances", json={"inferlet": "text-completion", "args": args, **kw})
    assert resp.status_code == 201, resp.text
    return resp.json()


def _attach_until_text(http, run_id):
    """An attached stream whose first text event has arrived: the instance is generating."""
    cm = http.stream("GET", f"/v1/instances/{run_id}/events")
    resp = cm.__enter__()
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    lines = resp.iter_lines()
    for line in lines:
        if line == "event: text":
            break
    return cm, lines


# ---- inferlets ------------------------------------------------------------------------------

def test_upload_is_content_addressed(http, text_completion_wasm):
    wasm = text_completion_wasm.read_bytes()
    first = http.post("/v1/inferlets", params={"name": "my-tc"}, content=wasm)
    assert first.status_code in (200, 201), first.text  # 200 when a rerun finds it kept from before
    card = first.json()
    assert card["hash"] == hashlib.sha256(wasm).hexdigest() and card["bytes"] == len(wasm)
    assert (card["name"], card["builtin"]) == ("my-tc", False)
    # curl --data-binary's content type: the body is read as bytes whatever it says
    again = http.post("/v1/inferlets", content=wasm, headers={"content-type": "application/x-www-form-urlencoded"})
    assert again.status_code == 200 and again.json()["hash"] == card["hash"] and again.json()["name"] == "my-tc"


def test_bad_components_are_refused_with_the_runtimes_message(http, runtime, text_completion_wasm,
                                                               bad_imports_wasm):
    for bad in (b"garbage, not a component", text_completion_wasm.read_bytes()[:4096],
                bad_imports_wasm.read_bytes()):
        with pytest.raises(PieError) as e:
            runtime.load(bad)
        err = _error(http.post("/v1/inferlets", content=bad), 400)
        assert err["code"] == "invalid_inferlet" and str(e.value) in err["message"]
    listed = {p["hash"] for p in http.get("/v1/inferlets").json()["data"]}
    assert hashlib.sha256(bad).hexdigest() not in listed


def test_component_of_another_world_is_refused_at_upload(http, runtime, other_world_wasm):
    """Issue 41 item 4: it was accepted (201) and every launch of it failed."""
    wasm = other_world_wasm.read_bytes()
    err = _error(http.post("/v1/inferlets", params={"name": "other"}, content=wasm), 400)
    assert err["code"] == "invalid_inferlet" and "pie:other/host@0.1.0" in err["message"], err
    assert "not built against the pie:inferlet@" in err["message"]
    listed = {p["hash"] for p in http.get("/v1/inferlets").json()["data"]}
    assert hashlib.sha256(wasm).hexdigest() not in listed


def test_oversize_upload_is_413(http, served):
    err = _error(http.post("/v1/inferlets", content=b"\0asm" + bytes(UPLOAD_LIMIT)), 413)
    assert err["code"] == "payload_too_large"
    assert http.get("/v1/models").status_code == 200  # still serving


def test_list_inferlets(http, text_completion_wasm):
    http.post("/v1/inferlets", params={"name": "my-tc"}, content=text_completion_wasm.read_bytes())
    data = http.get("/v1/inferlets").json()["data"]
    digest = hashlib.sha256(text_completion_wasm.read_bytes()).hexdigest()
    builtin = [p for p in data if p["builtin"]]
    assert {"name": "text-completion", "hash": digest, "builtin": True} in [
        {k: p[k] for k in ("name", "hash", "builtin")} for p in builtin]
    assert any(p["name"] == "my-tc" and p["hash"] == digest and not p["builtin"] for p in data)


def test_unknown_inferlet_and_instance_are_404(http):
    err = _error(http.post("/v1/instances", json={"inferlet": "no-such-inferlet"}), 404)
    assert err["code"] == "inferlet_not_found"
    _error(http.get("/v1/instances/inst_nope/events"), 404)
    _error(http.post("/v1/instances/inst_nope/cancel"), 404)
    assert _error(http.post("/v1/instances", json={"inferlet": "text-completion", "limits": {"bogus": 1}}),
                  400)["param"] == "limits.bogus"


def test_needs_a_key(served):
    assert httpx.get(served.url + "/v1/inferlets").status_code == 401
    assert httpx.post(served.url + "/v1/instances", json={"inferlet": "text-completion"}).status_code == 401


# ---- instances -----------------------------------------------------------------------------

@pytest.mark.parametrize("by", ["name", "hash"])
def test_launch_and_attach_equal_runtime_run(http, reference, text_completion_wasm, by):
    name = "text-completion" if by == "name" else hashlib.sha256(text_completion_wasm.read_bytes()).hexdigest()
    run = _launch(http, GREEDY, inferlet=name, limits={"wall_time": 600, "memory_mb": 256})
    assert run["limits"]["wall_time"] == 600.0 and run["limits"]["memory_mb"] == 256  # the cap, lowered
    with http.stream("GET", f"/v1/instances/{run['id']}/events") as resp:
        events = _events(resp.iter_lines())
    kinds = [e for e, _ in events]
    assert kinds[-3:] == ["tokens", "stats", "return"] and set(kinds[:-3]) == {"text"}
    data = dict(events[-3:])
    assert "".join(d["text"] for e, d in events if e == "text") == reference.text
    assert data["tokens"]["token_ids"] == reference.token_ids and len(reference.token_ids) == 10
    want = reference.to_json()
    assert {k: v for k, v in data["return"].items() if k != "stats"} == {k: v for k, v in want.items() if k != "stats"}
    assert data["return"]["stats"]["generated_tokens"] == 10 == data["stats"]["generated_tokens"]
    # an ended run can be attached again: the same events from the start
    with http.stream("GET", f"/v1/instances/{run['id']}/events") as resp:
        assert _events(resp.iter_lines()) == events
    assert http.get(f"/v1/instances/{run['id']}").json()["status"] == "succeeded"


def test_cancel_frees_pages_and_counts_as_an_instance(http, served):
    pool = served.service.engine.pool
    free = pool.free_pages
    run = _launch(http, ["--prompt", LONG, "--chat", "--max-tokens", "2000"], detach=True)
    cm, lines = _attach_until_text(http, run["id"])
    try:
        assert [r["id"] for r in http.get("/v1/instances").json()["data"] if r["status"] == "running"] == [run["id"]]
        # max_instances=1: the running inferlet takes the slot an OpenAI request would need
        busy = http.post("/v1/completions", json={"model": "smollm2-135m", "prompt": "Hi", "max_tokens": 1})
        assert _error(busy, 429)["code"] == "rate_limit_exceeded"
        assert http.post(f"/v1/instances/{run['id']}/cancel").status_code == 200
        events = _events(lines)
    finally:
        cm.__exit__(None, None, None)
    data = dict(events)
    assert data["return"]["error"] == "cancelled: a client asked to cancel it"
    assert data["error"]["error"]["code"] == "cancelled" and len(data["tokens"]["token_ids"]) < 2000
    served.wait_idle()
    assert pool.free_pages == free
    assert http.get(f"/v1/instances/{run['id']}").json()["status"] == "cancelled"


def test_disconnect_cancels_unless_detached(http, served):
    pool = served.service.engine.pool
    free = pool.free_pages
    run = _launch(http, ["--prompt", LONG, "--chat", "--max-tokens", "2000"])
    cm, _ = _attach_until_text(http, run["id"])
    cm.__exit__(None, None, None)  # the client goes away mid-stream
    served.wait_idle()
    card = http.get(f"/v1/instances/{run['id']}").json()
    assert (card["status"], card["error"]) == ("cancelled", "cancelled: the client went away")
    assert pool.free_pages == free

    run = _launch(http, ["--prompt", LONG, "--chat", "--max-tokens", "24"], detach=True)
    cm, _ = _attach_until_text(http, run["id"])
    cm.__exit__(None, None, None)
    with http.stream("GET", f"/v1/instances/{run['id']}/events") as resp:  # attach again: it ran to the end
        data = dict(_events(resp.iter_lines()))
    assert "error" not in data and len(data["return"]["token_ids"]) == 24
    served.wait_idle()
    assert pool.free_pages == free


# ---- pie run --server -----------------------------------------------------------------------

def _pie_run(served, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "host.cli", "run", "--server", served.url, "--api-key", KEY, *args],
                          capture_output=True, text=True, timeout=120)


def test_pie_run_server_prints_what_pie_run_prints(served, reference, text_completion_wasm):
    out = _pie_run(served, str(text_completion_wasm), "--json", "--", *GREEDY)  # uploads the file
    assert out.returncode == 0, out.stderr
    got, want = json.loads(out.stdout), reference.to_json()
    assert out.stdout.count("\n") == 1
    assert {k: got[k] for k in ("inferlet", "model", "text", "token_ids")} == \
        {k: want[k] for k in ("inferlet", "model", "text", "token_ids")}
    assert set(got) == set(want) and set(got["stats"]) == set(want["stats"])

    out = _pie_run(served, "text-completion", "--", *GREEDY)  # a built-in by name, streamed text
    assert out.returncode == 0, out.stderr
    assert out.stdout == reference.text + ("" if reference.text.endswith("\n") else "\n")

    out = _pie_run(served, "--wall-time", "0.001", "text-completion", "--json", "--", *GREEDY)  # a failed run
    assert out.returncode == 1 and "error" in json.loads(out.stdout)
    assert "pie: error: text-completion: cancelled: the inferlet exceeded its wall-time limit" in out.stderr

    out = _pie_run(served, "no-such-inferlet")
    assert out.returncode == 2 and "404" in out.stderr and "no inferlet 'no-such-inferlet'" in out.stderr


def test_pie_run_server_waits_out_a_429(http, served, reference):
    """max_instances=1, no queue: a launch refused with 429 is tried again after Retry-After."""
    import time

    from prometheus_client.parser import text_string_to_metric_families

    def refused() -> float:
        fams = text_string_to_metric_families(http.get("/metrics").text)
        return sum(s.value for f in fams for s in f.samples if s.name == "pie:http_requests_total"
                   and s.labels == {"endpoint": "/v1/instances", "status": "429"})
    holder = _launch(http, ["--prompt", LONG, "--chat", "--max-tokens", "2000"], detach=True)
    before = refused()
    proc = subprocess.Popen([sys.executable, "-m", "host.cli", "run", "--server", served.url, "--api-key", KEY,
                             "text-completion", "--", *GREEDY], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while refused() == before:  # a liveness guard: the launch has been refused at least once
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        http.post(f"/v1/instances/{holder['id']}/cancel")
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert out == reference.text + ("" if reference.text.endswith("\n") else "\n")

"""`pie serve` with two API keys (issue 41 items 5, 7, 8): upload names are per key, uploads have a
per-key quota, and /metrics names no upload (and can need a key)."""

from __future__ import annotations

import hashlib

import httpx
import pytest

from host.daemon.limits import ServeLimits
from test_daemon import KEY, Served
from wasm_fixtures import *  # noqa: F401,F403

pytestmark = [pytest.mark.model, pytest.mark.wasm]

KEY_B = "test-key-2"
GREEDY = ["--prompt", "Why is the sky blue?", "--chat", "--max-tokens", "4"]


@pytest.fixture(scope="module")
def served(runtime, text_completion_wasm, tmp_path_factory):
    s = Served(runtime, text_completion_wasm, max_instances=2, max_queue=0, api_keys=[KEY, KEY_B],
               builtin_dir=text_completion_wasm.parent, upload_dir=tmp_path_factory.mktemp("uploads"),
               max_upload_bytes=24 << 20, limits=ServeLimits(uploads_per_key=2), metrics_need_key=True)
    yield s
    s.stop()


def _client(served, key):
    return httpx.Client(base_url=served.url, headers={"Authorization": f"Bearer {key}"}, timeout=120)


@pytest.fixture
def a(served):
    with _client(served, KEY) as c:
        yield c


@pytest.fixture
def b(served):
    with _client(served, KEY_B) as c:
        yield c


def _wait(http, run_id):
    with http.stream("GET", f"/v1/instances/{run_id}/events") as resp:
        for _ in resp.iter_lines():
            pass


def test_names_are_per_key(served, a, b, text_completion_wasm, misbehave_wasm):
    tc, mb = text_completion_wasm.read_bytes(), misbehave_wasm.read_bytes()
    tc_hash, mb_hash = hashlib.sha256(tc).hexdigest(), hashlib.sha256(mb).hexdigest()
    assert a.post("/v1/inferlets", params={"name": "mine"}, content=tc).status_code == 201
    # B's `mine` is B's: A's launch of `mine` still runs A's component
    assert b.post("/v1/inferlets", params={"name": "mine"}, content=mb).status_code == 201
    run = a.post("/v1/instances", json={"inferlet": "mine", "args": GREEDY})
    assert run.status_code == 201 and run.json()["hash"] == tc_hash, run.text
    _wait(a, run.json()["id"])
    # item 9: the instance's KV quota counted against its key's, and gave its pages back to both
    (key_quota,) = served.service.instances._key_quotas.values()
    assert key_quota.limit == served.service.engine.pool.num_pages // 2 and key_quota.used == 0
    # B uploading A's bytes under another name shares the bytes, never A's name
    again = b.post("/v1/inferlets", params={"name": "stolen"}, content=tc)
    assert again.status_code == 201 and again.json()["name"] == "stolen"
    mine_a = {p["hash"]: p["name"] for p in a.get("/v1/inferlets").json()["data"] if not p["builtin"]}
    mine_b = {p["hash"]: p["name"] for p in b.get("/v1/inferlets").json()["data"] if not p["builtin"]}
    assert mine_a == {tc_hash: "mine"} and mine_b == {tc_hash: "stolen", mb_hash: "mine"}
    # another key's upload is not found by its hash either
    err = a.post("/v1/instances", json={"inferlet": mb_hash})
    assert err.status_code == 404 and err.json()["error"]["code"] == "inferlet_not_found"
    # /metrics labels uploads `custom`: no tenant's names, however many uploads
    text = a.get("/metrics").text
    assert 'inferlet="custom"' in text and 'inferlet="mine"' not in text


def test_metrics_can_need_a_key(served, a):
    assert httpx.get(served.url + "/metrics").status_code == 401
    assert a.get("/metrics").status_code == 200
    assert httpx.get(served.url + "/health").status_code == 200  # still open


def test_upload_count_quota_is_429_before_compiling(served, b, monkeypatch):
    monkeypatch.setattr(served.service.runtime, "load", lambda wasm: pytest.fail("compiled past the quota"))
    err = b.post("/v1/inferlets", content=b"\0asm\x0d\0\x01\0" + b"new bytes")
    assert err.status_code == 429, err.text
    assert err.json()["error"]["code"] == "upload_quota_exceeded" and "--max-uploads-per-key" in err.text
    assert "retry-after" not in err.headers  # not transient


def test_upload_storage_quota_is_413(runtime, text_completion_wasm, tmp_path):
    s = Served(runtime, text_completion_wasm, api_keys=[KEY], builtin_dir=text_completion_wasm.parent,
               upload_dir=tmp_path, max_upload_bytes=24 << 20, limits=ServeLimits(upload_storage_per_key=1 << 20))
    try:
        with _client(s, KEY) as c:
            err = c.post("/v1/inferlets", content=text_completion_wasm.read_bytes())
            assert err.status_code == 413, err.text
            assert err.json()["error"]["code"] == "upload_quota_exceeded" and "--max-upload-storage-mb" in err.text
    finally:
        s.stop()


def test_a_key_finds_only_its_own_prompts_in_the_prefix_cache(served, a, b):
    """Issue 43: the prefix cache is per key, so one tenant never reads another's rows, nor learns
    from a faster answer that another sent the same prompt."""
    body = {"model": "smollm2-135m", "max_tokens": 2, "temperature": 0,
            "prompt": "The tenancy rule of the prefix cache, stated at some length for a few blocks: " * 2}

    def cached(client):
        resp = client.post("/v1/completions", json=body)
        assert resp.status_code == 200, resp.text
        return resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached(a) == 0
    assert cached(b) == 0  # A's blocks are not B's
    assert cached(a) > 0 and cached(b) > 0  # each finds its own


def test_a_key_drafts_only_from_its_own_earlier_requests(served, a, b):
    """Issue 43: cacheback's cross-request drafts come from the suffix index of the request's own
    key: A's answer, listed when its run ended, drafts A's retry almost whole and B's hardly at all."""
    from wasm_fixtures import build_inferlet  # noqa: F811

    build_inferlet("cacheback-speculative-decoding")
    body = {"model": "smollm2-135m", "max_tokens": 32, "temperature": 0,
            "prompt": "Count from one to twenty in words, separated by commas:"}

    def drafted(client, inferlet):
        before = _metric(a, "pie:suffix_index_drafted_tokens_total")
        resp = client.post("/v1/completions", json={**body, "inferlet": inferlet})
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]["text"], _metric(a, "pie:suffix_index_drafted_tokens_total") - before

    text, _ = drafted(a, "text-completion")
    assert _metric(a, "pie:suffix_index_documents") >= 1
    text_b, by_b = drafted(b, "cacheback-speculative-decoding")
    text_a, by_a = drafted(a, "cacheback-speculative-decoding")
    assert text_a == text_b == text
    assert by_a >= 16 and by_a > by_b + 8, (by_a, by_b)


def _metric(client, name):
    resp = client.get("/metrics")
    assert resp.status_code == 200, resp.text
    for line in resp.text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} in /metrics")

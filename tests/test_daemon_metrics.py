"""`pie serve`: /health, the Prometheus metrics (latency histograms, speculative decoding counters
as vLLM names them) and the `inferlet` extension field of the completions endpoints."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from test_daemon import Served
from wasm_fixtures import *  # noqa: F401,F403
from wasm_fixtures import build_inferlet

pytestmark = [pytest.mark.model, pytest.mark.wasm]

CACHEBACK = "cacheback-speculative-decoding"
# text the answer copies: prompt lookup drafts, and most drafts are accepted
COPY = "Repeat this sentence exactly three times: The quick brown fox jumps over the lazy dog."
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def cacheback_wasm():
    return build_inferlet(CACHEBACK)


@pytest.fixture(scope="module")
def served(runtime, text_completion_wasm, cacheback_wasm):
    s = Served(runtime, text_completion_wasm, max_instances=2, builtin_dir=cacheback_wasm.parent)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def copy_reference(runtime, text_completion_wasm):
    res = runtime.run(text_completion_wasm, ["--prompt", COPY, "--chat", "--max-tokens", str(MAX_TOKENS)])
    assert res.ok, res.error
    return res


def _metrics(url: str) -> dict:
    """{(sample name, labels without model_name as a sorted tuple): value}."""
    text = httpx.get(url + "/metrics").text
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _delta(before: dict, after: dict, name: str, inferlet: str, **labels) -> float:
    key = (name, tuple(sorted({"inferlet": inferlet, **labels}.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_health(served, runtime, text_completion_wasm):
    resp = httpx.get(served.url + "/health")
    assert resp.status_code == 200 and resp.json()["status"] == "ok" and resp.json()["model"] == "smollm2-135m"
    other = Served(runtime, text_completion_wasm)
    try:
        other.service.instances.close()  # what a shutdown does first
        resp = httpx.get(other.url + "/health")
        assert resp.status_code == 503 and resp.json()["status"] == "shutting_down"
    finally:
        other.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_cacheback_through_the_inferlet_field_equals_text_completion(client, served, copy_reference, stream):
    before = _metrics(served.url)
    kw = dict(model="smollm2-135m", messages=[{"role": "user", "content": COPY}], max_tokens=MAX_TOKENS,
              temperature=0, extra_body={"inferlet": CACHEBACK, "inferlet_args": ["--draft-len", "4"]})
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kw))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        text = client.chat.completions.create(**kw).choices[0].message.content
    assert text == copy_reference.text
    after = _metrics(served.url)
    assert _delta(before, after, "pie:generation_tokens_total", CACHEBACK) == len(copy_reference.token_ids)
    assert _delta(before, after, "pie:spec_decode_num_draft_tokens_total", CACHEBACK) > 0
    assert _delta(before, after, "pie:spec_decode_num_drafts_total", "text-completion") == 0


def test_inferlet_field_errors(client):
    msgs = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2-135m", messages=msgs, extra_body={"inferlet": "no-such-one"})
    assert e.value.status_code == 400 and (e.value.code, e.value.param) == ("inferlet_not_found", "inferlet")
    assert e.value.body["message"].startswith("no inferlet 'no-such-one'")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smollm2-135m", prompt="Hi",
                                  extra_body={"inferlet": CACHEBACK, "inferlet_args": ["--max-tokens", "9"]})
    assert e.value.param == "inferlet_args"


def test_spec_decode_counters_equal_the_runs_stats(served):
    """A launched cacheback run: the counters grow by what its `stats` event reports."""
    from host.daemon.client import sse_events

    before = _metrics(served.url)
    with httpx.Client(base_url=served.url, timeout=120) as http:
        run = http.post("/v1/instances", json={"inferlet": CACHEBACK, "args": [
            "--prompt", COPY, "--chat", "--max-tokens", str(MAX_TOKENS)]}).json()
        with http.stream("GET", f"/v1/instances/{run['id']}/events") as resp:
            events = dict(sse_events(resp.iter_lines()))
    after = _metrics(served.url)
    stats = events["stats"]
    assert stats["drafted_tokens"] > 0 and stats["accepted_tokens"] > 0

    def d(name, **labels):
        return _delta(before, after, name, CACHEBACK, **labels)
    drafts = d("pie:spec_decode_num_drafts_total")
    assert d("pie:spec_decode_num_draft_tokens_total") == stats["drafted_tokens"]
    assert d("pie:spec_decode_num_accepted_tokens_total") == stats["accepted_tokens"]
    per_pos = [d("pie:spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
               for i in range(len(stats["acceptance_by_position"]))]
    assert sum(per_pos) == stats["accepted_tokens"]
    assert 0 < drafts <= stats["drafted_tokens"]
    assert round(per_pos[0] / drafts, 4) == stats["acceptance_by_position"][0]  # every draft has a position 0
    assert d("pie:generation_tokens_total") == stats["generated_tokens"] == len(events["tokens"]["token_ids"])
    assert d("pie:time_to_first_token_seconds_count") == 1 == d("pie:e2e_request_latency_seconds_count")
    assert 0 < d("pie:time_to_first_token_seconds_sum") <= d("pie:e2e_request_latency_seconds_sum")


def test_latency_histograms_count_each_completion(client, served):
    before = _metrics(served.url)
    out = client.completions.create(model="smollm2-135m", prompt="The capital of France is", max_tokens=6,
                                    temperature=0)
    after = _metrics(served.url)
    tc = "text-completion"
    assert _delta(before, after, "pie:time_to_first_token_seconds_count", tc) == 1
    assert _delta(before, after, "pie:e2e_request_latency_seconds_count", tc) == 1
    assert _delta(before, after, "pie:time_per_output_token_seconds_count", tc) == 1
    assert _delta(before, after, "pie:prompt_tokens_total", tc) == out.usage.prompt_tokens
    assert _delta(before, after, "pie:generation_tokens_total", tc) == out.usage.completion_tokens == 6
    e2e = _delta(before, after, "pie:e2e_request_latency_seconds_sum", tc)
    assert 0 < _delta(before, after, "pie:time_to_first_token_seconds_sum", tc) <= e2e
    # the buckets are cumulative: the last one holds the request
    assert _delta(before, after, "pie:e2e_request_latency_seconds_bucket", tc, le="+Inf") == 1


def test_default_inferlet_is_configurable(runtime, cacheback_wasm, copy_reference):
    s = Served(runtime, cacheback_wasm)  # pie serve --default-inferlet cacheback-speculative-decoding
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        out = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": COPY}],
                                             max_tokens=MAX_TOKENS, temperature=0)
        assert out.choices[0].message.content == copy_reference.text
        assert _metrics(s.url)[("pie:spec_decode_num_draft_tokens_total", (("inferlet", CACHEBACK),))] > 0
    finally:
        s.stop()


def test_per_request_spec_decode_metrics(served, client):
    """vLLM's per-request `metrics.speculative_decoding`, asked for with the extension field: the
    counts add up, whole and streamed; an answer that did not ask carries none."""
    kw = dict(model="smollm2-135m", messages=[{"role": "user", "content": COPY}], max_tokens=MAX_TOKENS, temperature=0)
    r = client.chat.completions.create(**kw, extra_body={"inferlet": CACHEBACK, "spec_decode_metrics": True})
    m = r.model_extra["metrics"]["speculative_decoding"]
    assert m["num_draft_tokens"] >= m["num_accepted_draft_tokens"] > 0 and m["num_spec_steps"] > 0
    hist = m["acceptance_histogram"]
    assert len(hist) == m["num_spec_tokens"] + 1 and sum(hist) == m["num_spec_steps"]
    assert sum(j * c for j, c in enumerate(hist)) == m["num_accepted_draft_tokens"]
    assert m["mean_acceptance_length"] == 1 + m["num_accepted_draft_tokens"] / m["num_spec_steps"]
    assert m["draft_acceptance_rate"] == m["num_accepted_draft_tokens"] / m["num_draft_tokens"]
    assert len(m["acceptance_by_position"]) == m["num_spec_tokens"] and 0 < m["acceptance_by_position"][0] <= 1
    # plain decoding drafts nothing
    plain = client.chat.completions.create(**kw, extra_body={"spec_decode_metrics": True})
    assert plain.model_extra["metrics"]["speculative_decoding"]["num_spec_steps"] == 0
    assert "metrics" not in (client.chat.completions.create(**kw).model_extra or {})
    # streamed: in the usage chunk, the same counts (greedy: the same rounds)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True},
                                                 extra_body={"inferlet": CACHEBACK, "spec_decode_metrics": True}))
    assert chunks[-1].usage is not None and chunks[-1].model_extra["metrics"]["speculative_decoding"] == m

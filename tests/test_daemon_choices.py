"""A request of several choices (issue 40): batched prompts, token-id prompts and `n`, with the
real `openai` client; the usage a stop string leaves; a stream that fails after its 200."""

from __future__ import annotations

import httpx
import openai
import pytest

from test_daemon import LONG, QUESTION, Served, _error, _metrics, _requests, reference  # noqa: F401 (fixture)
from wasm_fixtures import *  # noqa: F401,F403

pytestmark = [pytest.mark.model, pytest.mark.wasm]

MODEL = "smollm2-135m"
FRANCE = "The capital of France is"


@pytest.fixture(scope="module")
def served(runtime, text_completion_wasm):
    # two slots, no queue: a batch of three runs two at once, and its third waits for one of its own
    s = Served(runtime, text_completion_wasm, max_instances=2, max_queue=0)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture
def http(served):
    with httpx.Client(base_url=served.url, timeout=120) as c:
        yield c


PROMPTS = [FRANCE, QUESTION, "Once upon a time"]


def test_a_batch_of_prompts_gives_their_choices_in_order(client, reference, served):
    out = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=6, temperature=0)
    assert [c.index for c in out.choices] == [0, 1, 2]
    refs = [reference("--prompt", p, "--max-tokens", "6") for p in PROMPTS]
    assert [c.text for c in out.choices] == [r.text for r in refs]
    eos = set(served.service.engine.info.eos_ids)
    assert [c.finish_reason for c in out.choices] == ["stop" if r.token_ids[-1] in eos else "length" for r in refs]
    assert out.usage.completion_tokens == sum(len(r.token_ids) for r in refs)
    tok = served.service.engine.tokenizer
    assert out.usage.prompt_tokens == sum(len(tok.encode(p, add_special_tokens=False)) for p in PROMPTS)
    served.wait_idle()


def test_a_streamed_batch_interleaves_its_choices_by_index(client, reference, served):
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    texts, finished = ["", "", ""], [None, None, None]
    for c in chunks[:-1]:
        (choice,) = c.choices
        assert finished[choice.index] is None  # nothing of a choice after its end
        texts[choice.index] += choice.text
        finished[choice.index] = choice.finish_reason
    assert texts == [reference("--prompt", p, "--max-tokens", "6").text for p in PROMPTS]
    assert finished == [c.finish_reason for c in client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=6,
                                                                            temperature=0).choices]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == sum(
        len(reference("--prompt", p, "--max-tokens", "6").token_ids) for p in PROMPTS)
    served.wait_idle()


def test_token_id_prompts_equal_their_text(client, reference, served):
    tok = served.service.engine.tokenizer
    ids = [tok.encode(p, add_special_tokens=False) for p in PROMPTS[:2]]
    one = client.completions.create(model=MODEL, prompt=ids[0], max_tokens=6, temperature=0)
    assert one.choices[0].text == reference("--prompt", FRANCE, "--max-tokens", "6").text
    assert one.usage.prompt_tokens == len(ids[0])
    both = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert [c.text for c in both.choices] == [reference("--prompt", p, "--max-tokens", "6").text for p in PROMPTS[:2]]


def test_n_samples_are_the_seeded_requests_seed_plus_j(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0)
    out = client.completions.create(n=3, seed=7, **kw)
    assert [c.index for c in out.choices] == [0, 1, 2]
    alone = [client.completions.create(seed=7 + j, **kw).choices[0].text for j in range(3)]
    assert [c.text for c in out.choices] == alone
    assert len(set(alone)) > 1  # the samples differ (each its own seed)
    assert out.usage.prompt_tokens == client.completions.create(seed=7, **kw).usage.prompt_tokens  # counted once
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}], n=2,
                                          max_tokens=4, temperature=0)
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content  # greedy: the same


def test_a_prompts_samples_share_its_prefill(client, http, served):
    """Issue 53: the n samples of a prompt were n prefills. The first sample prefills it; the
    others start once it has emitted and take its blocks from the prefix cache, as the answer's
    usage and /metrics say; the texts are each seed's own (test above)."""
    block = served.service.engine.pool.page_size
    prompt = "A list of the rivers of Europe, longest first, with a sentence about each: " * 3
    before = _metrics(http)
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, n=3, temperature=1.0, seed=2)
    reused = (out.usage.prompt_tokens - 1) // block * block  # every full block before the last row
    assert reused >= 32 and out.usage.prompt_tokens_details.cached_tokens == 2 * reused
    after = _metrics(http)
    key = (("model_name", MODEL),)
    assert after[("pie:prefix_cache_hits_total", key)] - before.get(("pie:prefix_cache_hits_total", key), 0) \
        == 2 * reused
    assert after[("pie:prefix_cache_queries_total", key)] - before.get(("pie:prefix_cache_queries_total", key), 0) \
        >= 3 * out.usage.prompt_tokens
    served.wait_idle()


def test_a_batch_times_n_orders_choices_prompt_by_prompt(client):
    out = client.completions.create(model=MODEL, prompt=PROMPTS[:2], n=2, max_tokens=4, temperature=0)
    texts = [c.text for c in out.choices]
    assert texts[0] == texts[1] and texts[2] == texts[3] and texts[0] != texts[2]


def test_bad_choices_are_400_before_anything_runs(http, served):
    started = len(served.started)
    bad = [({"prompt": [5, served.service.engine.info.vocab_size]}, "outside the vocabulary"),
           ({"prompt": [[1, 2], [-3]]}, "outside the vocabulary"),
           ({"prompt": []}, "empty list"), ({"prompt": [[]]}, "empty"), ({"prompt": [FRANCE, ""]}, "empty"),
           ({"prompt": FRANCE, "n": 129}, "--max-choices"), ({"prompt": [FRANCE] * 65, "n": 2}, "--max-choices")]
    for body, words in bad:
        err = _error(http.post("/v1/completions", json={"model": MODEL, "max_tokens": 2, **body}), 400)
        assert words in err["message"] and err["param"] in ("prompt", "n"), (body, err)
    for body in ({"prompt": FRANCE, "n": 0}, {"prompt": [1, "a"]}, {"prompt": [True]}):
        assert http.post("/v1/completions", json={"model": MODEL, **body}).status_code in (400, 422), body
    assert len(served.started) == started  # refused whole: no choice of any ran


def test_usage_stops_at_the_token_that_completed_the_stop_string(client, reference, served):
    """Issue 40: tokens generated after the stop string, before the cancel took effect, were counted."""
    ref = reference("--prompt", QUESTION, "--chat", "--max-tokens", "24")
    tok = served.service.engine.tokenizer
    words = ref.text.split()
    stop = " " + words[len(words) // 3]
    want = next(k for k in range(1, len(ref.token_ids) + 1) if stop in tok.decode(ref.token_ids[:k]))
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                         max_tokens=24, temperature=0, stop=[stop])
    assert out.choices[0].finish_reason == "stop" and out.choices[0].message.content == ref.text[:ref.text.index(stop)]
    assert out.usage.completion_tokens == want < 24


def test_a_stream_that_fails_after_its_200_is_counted_as_failed(http, client, misbehave_wasm, served):
    """Issue 40: counted as 200 in pie:http_requests_total."""
    up = http.post("/v1/inferlets", content=misbehave_wasm.read_bytes())
    assert up.status_code in (200, 201), up.text
    before = _metrics(http)
    # three tokens streamed, then the loop's epilogue fails
    with http.stream("POST", "/v1/completions", json={
            "model": MODEL, "prompt": FRANCE, "max_tokens": 8, "stream": True, "inferlet": up.json()["hash"],
            "inferlet_args": ["--mode", "loop-emit-negative"]}) as resp:
        assert resp.status_code == 200
        body = "".join(resp.iter_text())
    assert '"error"' in body and body.rstrip().endswith("data: [DONE]")
    after = _metrics(http)
    endpoint = "/v1/completions"
    assert _requests(after, endpoint, 200) == _requests(before, endpoint, 200)
    assert sum(_requests(after, endpoint, s) - _requests(before, endpoint, s) for s in (400, 500, 503)) == 1


def test_prompt_ids_is_the_whole_prompt(runtime, text_completion_wasm):
    for args, words in ((["--prompt-ids", "1,2", "--prompt", "x"], "neither --prompt nor --chat"),
                        (["--prompt-ids", "1,2", "--chat"], "neither --prompt nor --chat"),
                        (["--prompt-ids", "1,-2"], "not a valid comma-separated list of token ids"),
                        (["--prompt-ids", "1,x"], "not a valid comma-separated list of token ids")):
        res = runtime.run(text_completion_wasm, args)
        assert not res.ok and words in res.error, (args, res.error)
    res = runtime.run(text_completion_wasm, ["--prompt-ids", "1,99999999"])
    assert not res.ok and "outside the vocabulary" in res.error


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_ended_by_a_limit_keeps_its_text_and_finishes_at_length(client, runtime, reference, served,
                                                                          monkeypatch, stream):
    """Issue 40: a request that reached a limit (here the compute-time budget of its device loop)
    answered a 500 and lost its text; now it is the text so far, finish_reason "length", and the
    limit's message in the choice's `limit`."""
    from host.runtime.limits import Limits

    monkeypatch.setattr(runtime, "limits", Limits(compute_time_s=0.3))
    kw = dict(model=MODEL, messages=[{"role": "user", "content": LONG}], max_tokens=4000, temperature=0)
    if stream:
        chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        last = [c for c in chunks if c.choices][-1].choices[0]
        n = chunks[-1].usage.completion_tokens
    else:
        out = client.chat.completions.create(**kw)
        text, last, n = out.choices[0].message.content, out.choices[0], out.usage.completion_tokens
    monkeypatch.undo()  # the reference runs under the usual limits
    assert last.finish_reason == "length"
    assert "compute-time limit of 0.3 s (--compute-time)" in last.model_extra["limit"]
    assert 1 < n < 4000 and text == reference("--prompt", LONG, "--chat", "--max-tokens", str(n)).text
    served.wait_idle()


@pytest.mark.parametrize("inferlet, extra", [(None, []), (None, ["--loop", "guest"]),
                                             ("cacheback-speculative-decoding", [])])
def test_top_k_and_min_p_shape_the_distribution(client, reference, inferlet, extra):
    """Issue 40: top_k and min_p were ignored. top_k=1 and min_p=1 leave only the most likely
    token, so a hot sample is the greedy text: through the device loop, the guest loop's host
    sampler (create-filtered-sampler) and speculative verification alike."""
    greedy = reference("--prompt", QUESTION, "--chat", "--max-tokens", "12").text
    body = {"inferlet_args": extra} | ({"inferlet": inferlet} if inferlet else {})
    kw = dict(model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=12, temperature=1.5, seed=3)
    for cut in ({"top_k": 1}, {"min_p": 1.0}):
        out = client.chat.completions.create(extra_body=body | cut, **kw)
        assert out.choices[0].message.content == greedy, cut
    loose = client.chat.completions.create(extra_body=body | {"top_k": 50, "min_p": 0.01}, **kw)
    assert loose.choices[0].message.content != greedy  # at temperature 1.5 the cut is what made them greedy


@pytest.mark.parametrize("inferlet, extra", [(None, []), (None, ["--loop", "guest"]),
                                             ("cacheback-speculative-decoding", []), ("ngram-proposer", [])])
def test_logit_bias_moves_greedy_and_sampled_choice(client, reference, served, inferlet, extra):
    """Issue 40: logit_bias was ignored. +100 on one token makes it every greedy and sampled
    choice; -100 on the greedy answer's first token makes the answer start otherwise."""
    body = {"inferlet_args": extra} | ({"inferlet": inferlet} if inferlet else {})
    kw = dict(model=MODEL, prompt=FRANCE, max_tokens=4)
    tok = served.service.engine.tokenizer
    favourite = tok.encode(" blue", add_special_tokens=False)[0]
    for temperature in (0, 1.0):
        out = client.completions.create(temperature=temperature, seed=1, extra_body=body | {
            "logit_bias": {str(favourite): 100}}, **kw)
        assert out.choices[0].text == tok.decode([favourite] * 4), temperature
    first = reference("--prompt", FRANCE, "--max-tokens", "4").token_ids[0]
    out = client.completions.create(temperature=0, extra_body=body | {"logit_bias": {str(first): -100}}, **kw)
    assert tok.encode(out.choices[0].text, add_special_tokens=False)[0] != first


@pytest.mark.parametrize("inferlet, extra", [(None, []), (None, ["--loop", "guest"]),
                                             ("cacheback-speculative-decoding", []), ("ngram-proposer", [])])
def test_penalties_are_served_as_plain_decoding_under_them(client, reference, inferlet, extra):
    """Issue 53: presence, frequency and repetition penalties were 400. A greedy answer under them
    is plain decoding's under the same penalties, whichever inferlet serves it."""
    body = {"inferlet_args": extra} | ({"inferlet": inferlet} if inferlet else {})
    flags = ["--presence-penalty", "0.8", "--frequency-penalty", "0.6", "--repetition-penalty", "1.3"]
    want = reference("--prompt", QUESTION, "--chat", "--max-tokens", "24", *flags).text
    assert want != reference("--prompt", QUESTION, "--chat", "--max-tokens", "24").text
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=24,
                                         temperature=0, presence_penalty=0.8, frequency_penalty=0.6,
                                         extra_body=body | {"repetition_penalty": 1.3})
    assert out.choices[0].message.content == want


def test_bad_penalties_are_400(http):
    for field, value in (("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0),
                         ("repetition_penalty", 2.5)):
        err = _error(http.post("/v1/completions", json={"model": MODEL, "prompt": FRANCE, field: value}), 400)
        assert err["param"] == field, err
    err = _error(http.post("/v1/completions", json={"model": MODEL, "prompt": FRANCE,
                                                     "inferlet_args": ["--presence-penalty", "1"]}), 400)
    assert err["param"] == "inferlet_args"


def test_bad_logit_biases_are_400(http):
    for bias, words in (({"abc": 1}, "not a token id"), ({"99999999": 1}, "not a token id"), ({"5": 101}, "outside")):
        err = _error(http.post("/v1/completions", json={"model": MODEL, "prompt": FRANCE, "logit_bias": bias}), 400)
        assert err["param"] == "logit_bias" and words in err["message"]

"""`pie serve` answers logprobs as OpenAI's endpoints do, with the run's own values (test_logprobs.py
shows they are plain decoding's bits): chat's `logprobs`/`top_logprobs` and the legacy completions'
`logprobs: N`, whole and streamed, through the `openai` client."""

from __future__ import annotations

import openai
import pytest

from test_daemon import Served, _error, reference  # noqa: F401 (fixture)
from wasm_fixtures import build_inferlet
from wasm_fixtures import *  # noqa: F401,F403

pytestmark = [pytest.mark.model, pytest.mark.wasm]

MODEL = "smollm2-135m"
QUESTION = "Name three colours of the rainbow."


@pytest.fixture(scope="module")
def served(runtime, text_completion_wasm):
    build_inferlet("cacheback-speculative-decoding")  # a request may name it
    s = Served(runtime, text_completion_wasm, max_instances=4, max_queue=8)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=300)


def _args(prompt: str, n: int) -> tuple:
    return ("--prompt", prompt, "--chat", "--max-tokens", str(n), "--temperature", "0.0", "--top-p", "1.0",
            "--top-k", "0", "--min-p", "0.0")


def test_chat_logprobs_are_the_runs(client, runtime, text_completion_wasm):
    want = runtime.run(text_completion_wasm, list(_args(QUESTION, 16)), logprobs=5)
    for inferlet in (None, "cacheback-speculative-decoding"):
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                           max_tokens=16, temperature=0, logprobs=True, top_logprobs=5,
                                           extra_body={"inferlet": inferlet} if inferlet else None)
        content = r.choices[0].logprobs.content
        assert [c.logprob for c in content] == [t.logprob for t in want.logprobs]
        assert "".join(c.token for c in content) == r.choices[0].message.content == want.text
        assert b"".join(bytes(c.bytes) for c in content).decode() == want.text
        for c, t in zip(content, want.logprobs):
            assert [a.logprob for a in c.top_logprobs] == [v for _, v in t.top]
            assert c.top_logprobs[0].token == c.token  # greedy
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=4)
    assert plain.choices[0].logprobs is None
    none = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=4,
                                          logprobs=True)
    assert all(c.top_logprobs == [] for c in none.choices[0].logprobs.content)


def test_streamed_chat_logprobs_come_with_their_text(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=24, temperature=0,
              logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**kw)
    text, entries = "", []
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        text += ch.delta.content or ""
        if ch.logprobs is not None:
            entries += ch.logprobs.content
            # a chunk's tokens are the text sent so far: never ahead of it
            assert "".join(e.token for e in entries) == text[:len("".join(e.token for e in entries))]
    assert text == whole.choices[0].message.content
    assert [e.model_dump() for e in entries] == [e.model_dump() for e in whole.choices[0].logprobs.content]


def test_completions_logprobs(client, runtime, text_completion_wasm):
    prompt = "The capital of France is"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == \
        r.usage.completion_tokens
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [len("".join(lp.tokens[:k])) for k in range(len(lp.tokens))]
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 3 <= len(top) <= 4 and top[tok] == value == max(top.values())  # greedy: the chosen one is the top
    want = runtime.run(text_completion_wasm, ["--prompt", prompt, "--max-tokens", "12"], logprobs=0)
    assert lp.token_logprobs == [t.logprob for t in want.logprobs]
    streamed = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logprobs=3,
                                              stream=True))
    got = [v for c in streamed if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert got == lp.token_logprobs


def test_stop_strings_cut_the_logprobs_with_the_text(client):
    kw = dict(model=MODEL, prompt="Count: 1, 2, 3, 4, 5,", max_tokens=24, temperature=0, logprobs=1)
    full = client.completions.create(**kw)
    stop = full.choices[0].text[5:8]
    cut = client.completions.create(stop=[stop], **kw)
    lp = cut.choices[0].logprobs
    assert cut.choices[0].finish_reason == "stop" and len(lp.tokens) == cut.usage.completion_tokens
    assert "".join(lp.tokens).startswith(cut.choices[0].text) and stop in "".join(lp.tokens)
    assert lp.token_logprobs == full.choices[0].logprobs.token_logprobs[:len(lp.tokens)]


@pytest.mark.parametrize("route, body, param", [
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
])
def test_bad_logprobs_fields_are_400(served, route, body, param):
    import httpx

    base = {"messages": [{"role": "user", "content": "Hi"}]} if "chat" in route else {"prompt": "Hi"}
    resp = httpx.post(served.url + route, json={"model": MODEL, "max_tokens": 1, **base, **body}, timeout=60)
    err = _error(resp, 400)
    assert param in (err["param"] or "") + err["message"]


# ---- echo: the prompt's logprobs --------------------------------------------------------------

def test_echo_scores_the_prompt_with_the_runs_bits(client, runtime, text_completion_wasm):
    """A run's generated tokens, echoed back as a prompt of ids, get the very logprobs the run gave them:
    the prompt pass computes each row as a decode does."""
    tok = runtime.engine.tokenizer
    prompt = tok.encode("The three primary colours are", add_special_tokens=False)
    run = runtime.run(text_completion_wasm, ["--prompt-ids", ",".join(map(str, prompt)), "--max-tokens", "12"],
                      logprobs=2)
    ids = prompt + run.token_ids
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=2)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == tok.decode(ids) and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 0
    assert len(lp.tokens) == len(ids) and "".join(lp.tokens) == r.choices[0].text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[len(prompt):] == [t.logprob for t in run.logprobs]
    for k, t in enumerate(run.logprobs):
        top = lp.top_logprobs[len(prompt) + k]
        assert sorted(top.values(), reverse=True)[:2] == [v for _, v in t.top]


def test_echo_before_a_completion(client):
    prompt = "Roses are red, violets are"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=1)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=1, echo=True)
    c, lp = r.choices[0], r.choices[0].logprobs
    assert c.text == prompt + plain.choices[0].text
    n = len(lp.tokens) - len(plain.choices[0].logprobs.tokens)
    assert lp.token_logprobs[n:] == plain.choices[0].logprobs.token_logprobs
    assert "".join(lp.tokens[:n]) == prompt and lp.text_offset[n] == len(prompt)
    assert lp.text_offset == [len("".join(lp.tokens[:k])) for k in range(len(lp.tokens))]
    # streamed: the prompt's chunk first, then the completion's, the same values
    chunks = [ch.choices[0] for ch in client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                                                  logprobs=1, echo=True, stream=True) if ch.choices]
    assert chunks[0].text == prompt and "".join(ch.text for ch in chunks) == c.text
    got = [v for ch in chunks if ch.logprobs for v in ch.logprobs.token_logprobs]
    assert got == lp.token_logprobs
    assert [o for ch in chunks if ch.logprobs for o in ch.logprobs.text_offset] == lp.text_offset
    # echo without logprobs: the text alone
    bare = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, echo=True)
    assert bare.choices[0].text == c.text and bare.choices[0].logprobs is None


def test_echo_of_a_batch_of_prompts(client):
    prompts = [[504, 2365, 282], [19556, 28, 940]]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=0, echo=True, logprobs=0, n=2)
    assert len(r.choices) == 4
    by = sorted(r.choices, key=lambda c: c.index)
    for k, c in enumerate(by):
        assert len(c.logprobs.tokens) == 3 and c.logprobs.token_logprobs[0] is None
        assert c.logprobs.token_logprobs == by[k - k % 2].logprobs.token_logprobs  # n copies of one prompt's
    assert by[0].logprobs.token_logprobs != by[2].logprobs.token_logprobs


def test_max_tokens_zero_needs_echo(served):
    import httpx

    resp = httpx.post(served.url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 0}, timeout=60)
    assert _error(resp, 400)["param"] == "max_tokens"

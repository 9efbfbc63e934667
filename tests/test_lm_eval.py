"""lm-evaluation-harness's `local-completions` model against `pie serve`: a small multiple-choice
task (written here, its items in a local JSON file) runs end to end, and every loglikelihood it
computed from the server's echoed logprobs equals HF's for the same token ids within 1e-4."""

from __future__ import annotations

import json
import math

import pytest
import torch

from test_daemon import Served
from wasm_fixtures import *  # noqa: F401,F403

pytestmark = [pytest.mark.model, pytest.mark.wasm]

ITEMS = [
    {"question": "The sky on a clear day is", "choices": ["blue", "green", "purple"], "answer": 0},
    {"question": "Two plus two equals", "choices": ["three", "four", "ten"], "answer": 1},
    {"question": "Water freezes at zero degrees", "choices": ["Kelvin", "Fahrenheit", "Celsius"], "answer": 2},
]

TASK = """task: pie_tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def served(runtime, text_completion_wasm):
    s = Served(runtime, text_completion_wasm, max_instances=4, max_queue=16)
    scored = []  # (prompt ids, the server's logprobs): what the harness was told
    echoes = s.service.echoes

    async def spy(request, plans, top):
        got = await echoes(request, plans, top)
        for plan, echo in zip(plans, got):
            scored.append((list(plan.prompt), [lp.logprob for _, lp in echo.entries]))
        return got
    s.service.echoes = spy
    s.scored = scored
    yield s
    s.stop()


def test_lm_eval_loglikelihoods_equal_hfs(served, engine, tmp_path, monkeypatch):
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):  # the task's items are a local file: no hub
        monkeypatch.setenv(var, "1")
    import lm_eval
    from lm_eval.tasks import TaskManager

    from host import store
    from host.engine.compute import compute

    data = tmp_path / "items.jsonl"
    data.write_text("".join(json.dumps(x) + "\n" for x in ITEMS))
    (tmp_path / "pie_tiny_choice.yaml").write_text(TASK.format(data=data))
    rec = store.read_record(engine.info.name)
    out = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=f"model={engine.info.name},base_url={served.url}/v1/completions,tokenizer={rec.path},"
                   "tokenized_requests=True,num_concurrent=1,max_retries=1,batch_size=1",
        tasks=["pie_tiny_choice"], task_manager=TaskManager(include_path=str(tmp_path)), log_samples=True)
    samples = out["samples"]["pie_tiny_choice"]
    assert len(samples) == len(ITEMS)
    got = [resp[0][0] for s in samples for resp in s["resps"]]  # per choice: [(loglikelihood, is_greedy)]
    assert len(got) == sum(len(x["choices"]) for x in ITEMS) and all(math.isfinite(v) and v < 0 for v in got)

    # every request the harness sent was scored as HF scores its ids
    ref = compute().call(lambda: store.load_model(rec, "cpu", "float32", keep_blocks=False).eval())
    worst = 0.0
    assert served.scored
    for ids, values in served.scored:
        def score(ids=ids):
            with torch.inference_mode():
                return torch.log_softmax(ref(torch.tensor([ids])).logits[0].float(), -1)
        lp = compute().call(score)
        hf = [float(lp[k - 1, t]) for k, t in enumerate(ids) if k > 0]
        worst = max(worst, max(abs(a - b) for a, b in zip(values[1:], hf)))
    print(f"lm-eval: max |pie - HF| over {sum(len(v) - 1 for _, v in served.scored)} prompt logprobs: {worst:.2e}")
    assert worst < 1e-4
    # and the harness's loglikelihoods are sums of those logprobs: each is one of the prompts' tails
    sums = [sum(v[-k:]) for _, v in served.scored for k in range(1, len(v))]
    assert all(min(abs(g - s) for s in sums) < 1e-9 for g in got)

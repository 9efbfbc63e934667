"""`pie serve` under concurrent streaming chat clients, against HF `generate` one request at a time.

    python -m bench.serve [--levels 1,4,8,16] [--prompts 16] [--requests 32] [--max-tokens 96]
                          [--rounds 3] [--dtype auto] [--inferlet text-completion] [--quick]
    python -m bench.serve --multi-turn ...   (conversations, prefix cache on and off: bench/multiturn.py;
                                              with --replicas N: prefix affinity on and off)
    python -m bench.serve --replicas N ...   (one server against N Ray Serve replicas: bench/replicas.py)
    python -m bench.serve --autoscale MAX ...  (a deployment scaling 1..MAX under load: bench/autoscale.py)

Starts `pie serve` in a subprocess (so the clients do not share its interpreter), then for each
level sends the same requests (the first --prompts dev prompts in the chat template, cycled to
--requests) from that many concurrent streaming clients (httpx, greedy, stream_options.include_usage).
Per level: aggregate tokens/s (completion tokens over the level's wall time), time to first token
and inter-token latency (the gap between successive content chunks, as vLLM's benchmark_serving
measures it) at p50 and p90, requests lost (an error or a missing [DONE]) and mixed up (text unlike
the same prompt's at level 1, where each request ran alone). The levels run --rounds times,
interleaved (1, 4, 8, 16, 1, 4, ...), since a shared machine's speed drifts by more than the
differences measured: a level's figures pool its rounds, and its ratio to one client is the median
of each round's ratio to that round's own 1-client run. The server then stops and HF `generate`
runs the same requests one at a time, with a streamer timing each token. Writes
results/serve.{json,md,png}. --quick: 8 prompts, 16 requests, 32 tokens, 1 round.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from .common import RESULTS, ROOT, chat_ids, load_hf, load_prompts, machine, on_compute, table, write


@dataclass
class Sample:
    """One request as its client saw it: times are perf_counter seconds."""

    request: int
    prompt: int
    sent: float
    chunks: list[float] = field(default_factory=list)  # arrival of each chunk with content
    end: float = 0.0
    text: str = ""
    tokens: int = 0
    error: str | None = None
    replica: str | None = None  # x-pie-replica: which replica of a deployment answered

    @property
    def ttft(self) -> float | None:
        return self.chunks[0] - self.sent if self.chunks else None

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.chunks, self.chunks[1:])]


def _stream(http, model: str, prompt: str, max_tokens: int, sample: Sample, user: str | None = None) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    if user is not None:
        body["user"] = user
    text, done = [], False
    with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        sample.replica = resp.headers.get("x-pie-replica")
        if resp.status_code != 200:
            sample.error = f"{resp.status_code}: {resp.read().decode(errors='replace')[:200]}"
            return
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                sample.error = chunk["error"]["message"]
                continue
            if chunk.get("usage"):
                sample.tokens = chunk["usage"]["completion_tokens"]
            for c in chunk["choices"]:
                if c["delta"].get("content"):
                    sample.chunks.append(time.perf_counter())
                    text.append(c["delta"]["content"])
    sample.end = time.perf_counter()
    sample.text = "".join(text)
    if not done and sample.error is None:
        sample.error = "the stream ended without [DONE]"


def run_level(url: str, model: str, prompts: list[str], order: list[int], clients: int, max_tokens: int):
    """Every request in `order` (prompt indices), `clients` at a time; (samples, wall seconds)."""
    import httpx

    todo: queue.Queue[int] = queue.Queue()
    for i in range(len(order)):
        todo.put(i)
    samples: list[Sample | None] = [None] * len(order)

    def client() -> None:
        with httpx.Client(base_url=url, timeout=httpx.Timeout(30, read=600)) as http:
            while True:
                try:
                    i = todo.get_nowait()
                except queue.Empty:
                    return
                s = samples[i] = Sample(i, order[i], time.perf_counter())
                try:
                    _stream(http, model, prompts[order[i]], max_tokens, s)
                except Exception as e:  # a lost request is a result here, not a crash
                    s.error, s.end = f"{type(e).__name__}: {e}", time.perf_counter()
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return samples, time.perf_counter() - t0


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def summarize(samples: list[Sample], wall: float, alone: dict[int, str] | None) -> dict:
    ok = [s for s in samples if s.error is None]
    ttft = [s.ttft for s in ok if s.ttft is not None]
    gaps = [g for s in ok for g in s.gaps()]
    mixed = [s.request for s in ok if alone is not None and s.text != alone[s.prompt]]
    tokens = sum(s.tokens for s in ok)
    # the machine's 1-minute load average as the level ended: on a shared VM, other work shows here
    return {"requests": len(samples), "lost": len(samples) - len(ok), "mixed": len(mixed), "tokens": tokens,
            "load_avg_1m": os.getloadavg()[0],
            "wall_s": wall, "tokens_per_s": tokens / wall, "ttft_p50_s": pct(ttft, 50), "ttft_p90_s": pct(ttft, 90),
            "itl_p50_s": pct(gaps, 50), "itl_p90_s": pct(gaps, 90),
            "errors": sorted({s.error for s in samples if s.error})[:5]}


class Server:
    """`pie serve` in a subprocess on a free loopback port; its log goes to a temporary file."""

    def __init__(self, args, max_instances: int):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="pie-serve-bench-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "host.cli", "serve", "--port", str(self.port), "--dtype", args.dtype,
               "--max-instances", str(max_instances), "--max-queue", "0", "--default-inferlet", args.inferlet]
        if args.model:
            cmd += ["--model", args.model]
        cmd += list(getattr(args, "extra", []))
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        self._wait_ready()

    def _wait_ready(self) -> None:
        import httpx

        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pie serve exited: {self.tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"pie serve did not start: {self.tail()}")
            try:
                if httpx.get(self.url + "/health").status_code == 200:
                    self.model = httpx.get(self.url + "/v1/models").json()["data"][0]["id"]
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.3)

    def tail(self) -> str:
        with open(self.log.name, errors="replace") as f:
            return f.read()[-2000:]

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.unlink(self.log.name)


class _Clock:
    """A transformers streamer that times each new token (its first put() is the prompt)."""

    def __init__(self):
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True

    def end(self) -> None:
        pass


@torch.inference_mode()
def _hf_one(model, tokenizer, ids: list[int], max_tokens: int, sample: Sample) -> None:
    clock = _Clock()
    x = torch.tensor([ids], device=model.device)
    sample.sent = time.perf_counter()
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens, do_sample=False,
                         pad_token_id=tokenizer.eos_token_id, streamer=clock)
    sample.end = time.perf_counter()
    new = out[0, len(ids):].tolist()
    sample.chunks, sample.tokens = clock.times, len(new)
    sample.text = tokenizer.decode(new, skip_special_tokens=True)


def run_hf(engine, ids: list[list[int]], order: list[int], max_tokens: int):
    hf = load_hf(engine)
    on_compute(_hf_one, hf, engine.tokenizer, ids[0], 4, Sample(-1, 0, 0.0))  # warm-up
    samples = []
    t0 = time.perf_counter()
    for i, p in enumerate(order):
        s = Sample(i, p, 0.0)
        on_compute(_hf_one, hf, engine.tokenizer, ids[p], max_tokens, s)
        samples.append(s)
    return samples, time.perf_counter() - t0


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--multi-turn" in argv:  # conversations with the prefix cache on and off: bench/multiturn.py
        from . import multiturn

        return multiturn.main([a for a in argv if a != "--multi-turn"])
    if "--autoscale" in argv:  # a deployment scaling under load and back: bench/autoscale.py
        from . import autoscale

        return autoscale.main(argv)
    if "--replicas" in argv:  # one server against a Ray Serve deployment: bench/replicas.py
        from . import replicas

        return replicas.main(argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--levels", default="1,4,8,16", help="concurrent clients per level (1 always runs first)")
    ap.add_argument("--prompts", type=int, default=16, help="first N dev prompts")
    ap.add_argument("--requests", type=int, default=32, help="requests per level (prompts cycled)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--inferlet", default="text-completion", help="pie serve --default-inferlet")
    ap.add_argument("--no-hf", action="store_true", help="skip the HF generate baseline")
    ap.add_argument("--rounds", type=int, default=3, help="times every level runs, interleaved (default 3)")
    ap.add_argument("--quick", action="store_true", help="8 prompts, 16 requests, 32 tokens, 1 round")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.requests, args.max_tokens, args.rounds = 8, 16, 32, 1
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    levels = sorted({1, *(int(x) for x in args.levels.split(","))})
    rows = load_prompts(args.prompts)
    prompts = [r["prompt"] for r in rows]
    order = [i % len(prompts) for i in range(max(args.requests, len(prompts), levels[-1]))]

    server = Server(args, levels[-1])
    try:
        run_level(server.url, server.model, prompts, order[:2], 1, 4)  # warm-up: compiled components, caches
        alone = None
        pooled: dict[int, list[Sample]] = {c: [] for c in levels}
        walls = {c: 0.0 for c in levels}
        rates: dict[int, list[float]] = {c: [] for c in levels}  # tokens/s of each round
        for r in range(args.rounds):
            for c in levels:
                samples, wall = run_level(server.url, server.model, prompts, order, c, args.max_tokens)
                if alone is None:  # level 1 of round 1: each request ran alone
                    alone = {s.prompt: s.text for s in samples if s.error is None}
                one_round = summarize(samples, wall, alone)
                pooled[c] += samples
                walls[c] += wall
                rates[c].append(one_round["tokens_per_s"])
                print(f"round {r + 1}, {c:>3} clients: {one_round['tokens_per_s']:.1f} tok/s, "
                      f"lost {one_round['lost']}, mixed {one_round['mixed']}", flush=True)
        per_level = {}
        for c in levels:
            per_level[c] = summarize(pooled[c], walls[c], alone)
            ratios = [a / b for a, b in zip(rates[c], rates[1])]
            per_level[c].update(rounds=args.rounds, tokens_per_s_rounds=rates[c], vs_one_rounds=ratios,
                                vs_one=float(np.median(ratios)))
    finally:
        server.stop()

    from host import store

    engine = store.open_engine(args.model, device="auto", dtype=args.dtype)  # to name dtype and device, and for HF
    hf = None
    if not args.no_hf:
        ids = [chat_ids(engine.tokenizer, p) for p in prompts]
        samples, wall = run_hf(engine, ids, order, args.max_tokens)
        hf = summarize(samples, wall, None)
        hf["same_text_as_server"] = sum(s.text == alone.get(s.prompt) for s in samples)

    result = {"benchmark": "serve", "model": engine.info.name, "dtype": engine.info.dtype,
              "device": engine.info.device, "inferlet": args.inferlet, "prompts": [r["id"] for r in rows],
              "requests": len(order), "rounds": args.rounds, "max_tokens": args.max_tokens, "machine": machine(),
              "levels": per_level, "hf_generate_sequential": hf,
              "lost_total": sum(v["lost"] for v in per_level.values()),
              "mixed_total": sum(v["mixed"] for v in per_level.values())}
    one = per_level[1]["tokens_per_s"]
    trows = [[f"pie serve, {c} client(s)", v["tokens_per_s"], v["vs_one"],
              " / ".join(f"{x:.2f}" for x in v["vs_one_rounds"]), v["ttft_p50_s"] * 1e3,
              v["ttft_p90_s"] * 1e3, v["itl_p50_s"] * 1e3, v["itl_p90_s"] * 1e3, v["lost"], v["mixed"],
              v["load_avg_1m"]] for c, v in per_level.items()]
    if hf is not None:
        trows.append(["HF generate, one at a time", hf["tokens_per_s"], hf["tokens_per_s"] / one, "-",
                      hf["ttft_p50_s"] * 1e3, hf["ttft_p90_s"] * 1e3, hf["itl_p50_s"] * 1e3, hf["itl_p90_s"] * 1e3,
                      hf["lost"], "-", hf["load_avg_1m"]])
    md = (f"pie serve ({args.inferlet}), {engine.info.name} {engine.info.dtype} on {engine.info.device}; "
          f"{len(order)} streaming chat requests per level and round over dev prompts {result['prompts']}, greedy, "
          f"max_tokens {args.max_tokens}; {args.rounds} round(s) of the levels, interleaved. tok/s: all rounds "
          f"pooled; vs 1 client: the median over rounds of each round's ratio to its own 1-client run (each "
          f"round's after it). TTFT from sending the request (queueing included); ITL between "
          f"content chunks. Mixed: text unlike the same prompt's at 1 client. Load: the machine's 1-minute "
          f"load average at the end of the level ({os.cpu_count()} CPUs; above that, other work shared them).\n\n"
          + table(["contender", "tok/s", "vs 1 client", "each round", "TTFT p50 ms", "TTFT p90 ms", "ITL p50 ms", "ITL p90 ms",
                   "lost", "mixed", "load"], trows))
    if hf is not None:
        md += f"\n\nHF generate's text equals the server's (1 client) on {hf['same_text_as_server']}/{len(order)} requests."
    path = write("serve", result, md)
    chart(per_level, hf)
    print(md)
    print(f"\nwrote {path} and results/serve.png")
    return result


def chart(per_level: dict, hf: dict | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cs = list(per_level)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.plot(cs, [per_level[c]["tokens_per_s"] for c in cs], "o-", label="pie serve")
    if hf is not None:
        left.axhline(hf["tokens_per_s"], color="grey", ls="--", label="HF generate, one at a time")
    left.set_xlabel("concurrent streaming clients")
    left.set_ylabel("aggregate tokens/s")
    left.set_xticks(cs)
    left.legend(fontsize=8)
    for key, label in (("ttft_p50_s", "TTFT p50"), ("itl_p50_s", "ITL p50")):
        right.plot(cs, [per_level[c][key] * 1e3 for c in cs], "o-", label=label)
    right.set_xlabel("concurrent streaming clients")
    right.set_ylabel("ms")
    right.set_yscale("log")
    right.set_xticks(cs)
    right.legend(fontsize=8)
    fig.tight_layout()
    RESULTS.mkdir(exist_ok=True)
    fig.savefig(RESULTS / "serve.png", dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()

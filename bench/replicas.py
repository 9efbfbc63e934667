"""One `pie serve` against a Ray Serve deployment of replicas on the same machine, the same load.

    python -m bench.serve --replicas 2 [--threads-per-replica 1] [--levels 1,4,8,16] [--prompts 16]
                          [--requests 32] [--max-tokens 96] [--rounds 2] [--dtype auto]
                          [--inferlet text-completion] [--quick]

Two `pie serve` subprocesses: one server (torch's threads: every core) and `--replicas N
--threads-per-replica T` (Ray Serve's proxy, router and N replicas on a local Ray cluster). Each
level's requests (bench/serve.py's streaming chat clients) go to one contender then the other,
round after round, interleaved. Per contender and level: tokens/s, TTFT p50/p90, requests lost or
mixed up (text unlike the one server's at 1 client: greedy output must not depend on the replica).
The Ray path's own cost per request: the round trip of GET /v1/models (no model work) and of a
1-token completion, at 1 client, medians of --pings requests. Writes results/replicas.{json,md,png}.
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

from .common import load_prompts, machine, table, write
from .serve import Server, run_level, summarize


def _wait_replicas(server: Server, n: int, timeout: float = 300) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while httpx.get(server.url + "/health", timeout=30).json().get("replicas") != n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the deployment's {n} replicas did not all report: {server.tail()}")
        time.sleep(0.5)


def ping(url: str, model: str, n: int) -> dict:
    """Median milliseconds of GET /v1/models and of a 1-token completion, one at a time."""
    import httpx

    with httpx.Client(base_url=url, timeout=60) as http:
        def timed(f) -> float:
            t0 = time.perf_counter()
            f().raise_for_status()
            return (time.perf_counter() - t0) * 1e3
        models = [timed(lambda: http.get("/v1/models")) for _ in range(n)]
        body = {"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
        one = [timed(lambda: http.post("/v1/completions", json=body)) for _ in range(n)]
    return {"models_ms": statistics.median(models), "one_token_ms": statistics.median(one)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, required=True)
    ap.add_argument("--threads-per-replica", type=int, default=1)
    ap.add_argument("--model", default=None)
    ap.add_argument("--levels", default="1,4,8,16")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--pings", type=int, default=50, help="requests timed one at a time for the Ray path's cost")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--inferlet", default="text-completion")
    ap.add_argument("--quick", action="store_true", help="8 prompts, 16 requests, 32 tokens, 1 round, 20 pings")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.requests, args.max_tokens, args.rounds, args.pings = 8, 16, 32, 1, 20
    levels = sorted({1, *(int(x) for x in args.levels.split(","))})
    rows = load_prompts(args.prompts)
    prompts = [r["prompt"] for r in rows]
    order = [i % len(prompts) for i in range(max(args.requests, len(prompts), levels[-1]))]
    names = ["one server", f"{args.replicas} replicas x {args.threads_per_replica} thread(s)"]
    base = dict(model=args.model, dtype=args.dtype, inferlet=args.inferlet)
    servers = [Server(SimpleNamespace(**base, extra=[]), levels[-1])]
    try:
        servers.append(Server(SimpleNamespace(**base, extra=[
            "--replicas", str(args.replicas), "--threads-per-replica", str(args.threads_per_replica),
            "--replica-cpus", "1"]), levels[-1]))
        _wait_replicas(servers[1], args.replicas)
        model = servers[0].model
        for s in servers:
            run_level(s.url, model, prompts, order[:2], 1, 4)  # warm-up: compiled components, caches
        pings = [ping(s.url, model, args.pings) for s in servers]
        alone: dict[int, str] | None = None
        pooled = [{c: [] for c in levels} for _ in servers]
        walls = [{c: 0.0 for c in levels} for _ in servers]
        for r in range(args.rounds):
            for c in levels:
                for k, s in enumerate(servers):
                    samples, wall = run_level(s.url, model, prompts, order, c, args.max_tokens)
                    if alone is None:  # the one server at 1 client, first round: each request alone
                        alone = {x.prompt: x.text for x in samples if x.error is None}
                    pooled[k][c] += samples
                    walls[k][c] += wall
                    one = summarize(samples, wall, alone)
                    print(f"round {r + 1}, {names[k]}, {c:>3} clients: {one['tokens_per_s']:.1f} tok/s, "
                          f"lost {one['lost']}, mixed {one['mixed']}", flush=True)
    finally:
        for s in servers:
            s.stop()
    per = [{c: summarize(pooled[k][c], walls[k][c], alone) for c in levels} for k in range(len(servers))]
    result = {"benchmark": "replicas", "replicas": args.replicas, "threads_per_replica": args.threads_per_replica,
              "inferlet": args.inferlet, "prompts": [r["id"] for r in rows], "requests": len(order),
              "rounds": args.rounds, "max_tokens": args.max_tokens, "machine": machine(),
              "contenders": {names[k]: {"levels": per[k], "ping": pings[k]} for k in range(len(servers))},
              "ray_path_ms": {"models": pings[1]["models_ms"] - pings[0]["models_ms"],
                              "one_token": pings[1]["one_token_ms"] - pings[0]["one_token_ms"]},
              "lost_total": sum(v["lost"] for p in per for v in p.values()),
              "mixed_total": sum(v["mixed"] for p in per for v in p.values())}
    trows = []
    for c in levels:
        for k in range(len(servers)):
            v = per[k][c]
            trows.append([f"{names[k]}, {c} client(s)", v["tokens_per_s"], v["tokens_per_s"] / per[0][c]["tokens_per_s"],
                          v["ttft_p50_s"] * 1e3, v["ttft_p90_s"] * 1e3, v["lost"], v["mixed"]])
    md = (f"`pie serve` ({args.inferlet}) alone against `--replicas {args.replicas} --threads-per-replica "
          f"{args.threads_per_replica}` on this machine; {len(order)} streaming chat requests per level and round "
          f"over dev prompts {result['prompts']}, greedy, max_tokens {args.max_tokens}; {args.rounds} round(s), "
          "the contenders interleaved per level. Mixed: text unlike the one server's at 1 client.\n\n"
          + table(["contender", "tok/s", "vs one server", "TTFT p50 ms", "TTFT p90 ms", "lost", "mixed"], trows)
          + "\n\nThe Ray path's cost per request at 1 client (medians of "
          f"{args.pings}): GET /v1/models {pings[0]['models_ms']:.2f} ms alone, {pings[1]['models_ms']:.2f} ms "
          f"through the proxy and router ({result['ray_path_ms']['models']:+.2f} ms); a 1-token completion "
          f"{pings[0]['one_token_ms']:.1f} ms against {pings[1]['one_token_ms']:.1f} ms "
          f"({result['ray_path_ms']['one_token']:+.1f} ms, a replica's one thread included).")
    path = write("replicas", result, md)
    _chart(names, levels, per)
    print(md)
    print(f"\nwrote {path} and results/replicas.png")
    return result


def _chart(names, levels, per) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .common import RESULTS

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for k, name in enumerate(names):
        a.plot(levels, [per[k][c]["tokens_per_s"] for c in levels], marker="o", label=name)
        b.plot(levels, [per[k][c]["ttft_p50_s"] * 1e3 for c in levels], marker="o", label=name)
    a.set(xlabel="concurrent clients", ylabel="tokens/s", title="throughput")
    b.set(xlabel="concurrent clients", ylabel="ms", title="TTFT p50")
    a.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "replicas.png", dpi=110)

"""A deployment that scales under load and back, and loses no request on the way.

    python -m bench.serve --autoscale MAX [--clients 8] [--load-s 120] [--idle-s 60] [--target 2]
                          [--upscale-delay-s 5] [--downscale-delay-s 20] [--prompts 16] [--max-tokens 64]
                          [--dtype auto] [--inferlet text-completion]

Starts `pie serve --replicas 1 --min-replicas 1 --max-replicas MAX --target-ongoing-requests T`
(replicas of one thread) with the given delays. Then --clients streaming chat clients send the
dev prompts in turn for --load-s seconds; then none for --idle-s. A poller reads /health every
second: the replicas reporting, running and waiting. Reports the timeline, when each replica
count was first seen, the requests sent, completed and lost (an error or no [DONE]; each client
is a user of its own, so prefix affinity spreads them), requests per replica, and tokens/s in
each 20 s of load. Writes results/autoscale.{json,md,png}.
"""

from __future__ import annotations

import argparse
import threading
import time
from types import SimpleNamespace

from .common import load_prompts, machine, table, write
from .serve import Sample, Server, _stream


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--autoscale", type=int, required=True, metavar="MAX")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--load-s", type=float, default=120)
    ap.add_argument("--idle-s", type=float, default=60)
    ap.add_argument("--target", type=float, default=2, help="--target-ongoing-requests")
    ap.add_argument("--upscale-delay-s", type=float, default=5)
    ap.add_argument("--downscale-delay-s", type=float, default=20)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--inferlet", default="text-completion")
    args = ap.parse_args(argv)
    import httpx

    prompts = [r["prompt"] for r in load_prompts(args.prompts)]
    extra = ["--replicas", "1", "--min-replicas", "1", "--max-replicas", str(args.autoscale),
             "--target-ongoing-requests", str(args.target), "--upscale-delay-s", str(args.upscale_delay_s),
             "--downscale-delay-s", str(args.downscale_delay_s), "--threads-per-replica", "1", "--replica-cpus", "1"]
    server = Server(SimpleNamespace(model=args.model, dtype=args.dtype, inferlet=args.inferlet, extra=extra),
                    args.clients)
    timeline: list[dict] = []
    samples: list[Sample] = []
    stop_load, stop_poll = threading.Event(), threading.Event()
    try:
        t0 = time.perf_counter()

        def poll():
            with httpx.Client(base_url=server.url, timeout=10) as http:
                while not stop_poll.is_set():
                    try:
                        h = http.get("/health").json()
                        timeline.append({"t": round(time.perf_counter() - t0, 1), "replicas": h.get("replicas"),
                                         "running": h.get("running"), "waiting": h.get("waiting")})
                    except (httpx.HTTPError, ValueError) as e:
                        timeline.append({"t": round(time.perf_counter() - t0, 1), "error": type(e).__name__})
                    stop_poll.wait(1.0)

        def client(c: int):
            with httpx.Client(base_url=server.url, timeout=httpx.Timeout(30, read=600)) as http:
                i = c
                while not stop_load.is_set():
                    s = Sample(len(samples), i % len(prompts), time.perf_counter())
                    samples.append(s)
                    try:
                        _stream(http, server.model, prompts[i % len(prompts)], args.max_tokens, s, user=f"client{c}")
                    except Exception as e:  # a lost request is a result here, not a crash
                        s.error, s.end = f"{type(e).__name__}: {e}", time.perf_counter()
                    i += args.clients

        poller = threading.Thread(target=poll)
        poller.start()
        clients = [threading.Thread(target=client, args=(c,)) for c in range(args.clients)]
        for t in clients:
            t.start()
        time.sleep(args.load_s)
        stop_load.set()
        for t in clients:
            t.join()
        load_end = time.perf_counter() - t0
        time.sleep(args.idle_s)
        stop_poll.set()
        poller.join()
    finally:
        server.stop()
    first_seen: dict[int, float] = {}
    for row in timeline:
        if row.get("replicas") is not None:
            first_seen.setdefault(row["replicas"], row["t"])
    back_to_one = next((r["t"] for r in timeline if r["t"] > load_end and r.get("replicas") == 1), None)
    lost = [s for s in samples if s.error]
    by_replica: dict[str, int] = {}
    for s in samples:
        if s.replica and not s.error:
            by_replica[s.replica] = by_replica.get(s.replica, 0) + 1
    windows = []
    w = 20.0
    for k in range(int(args.load_s // w)):
        lo, hi = t0 + k * w, t0 + (k + 1) * w
        toks = sum(s.tokens for s in samples if not s.error and lo <= s.end < hi)
        seen = [r["replicas"] for r in timeline if k * w <= r["t"] < (k + 1) * w and r.get("replicas")]
        windows.append({"from_s": k * w, "to_s": (k + 1) * w, "tokens_per_s": toks / w,
                        "replicas": max(seen) if seen else None})
    result = {"benchmark": "autoscale", "args": vars(args), "machine": machine(), "load_end_s": round(load_end, 1),
              "first_seen_s": first_seen, "back_to_one_s": back_to_one, "sent": len(samples),
              "completed": len(samples) - len(lost), "lost": len(lost),
              "lost_errors": sorted({s.error for s in lost})[:5], "by_replica": by_replica, "windows": windows,
              "timeline": timeline}
    md = (f"`pie serve --replicas 1 --min-replicas 1 --max-replicas {args.autoscale} --target-ongoing-requests "
          f"{args.target} --upscale-delay-s {args.upscale_delay_s} --downscale-delay-s {args.downscale_delay_s}` "
          f"(replicas of one thread), {args.clients} streaming chat clients for {args.load_s:.0f} s over dev prompts "
          f"1..{args.prompts} (max_tokens {args.max_tokens}, greedy), then {args.idle_s:.0f} s idle.\n\n"
          + table(["replicas", "first seen at (s)"], [[n, t] for n, t in sorted(first_seen.items())])
          + f"\n\nLoad ended at {load_end:.1f} s; back to 1 replica at "
          f"{'never (within the idle time)' if back_to_one is None else f'{back_to_one:.1f} s'}. "
          f"Requests sent {len(samples)}, completed {len(samples) - len(lost)}, lost {len(lost)}"
          + (f" ({result['lost_errors']})" if lost else "") + f"; answered per replica: {by_replica}.\n\n"
          + table(["load window (s)", "tokens/s", "replicas"],
                  [[f"{x['from_s']:.0f}-{x['to_s']:.0f}", x["tokens_per_s"], x["replicas"]] for x in windows]))
    path = write("autoscale", result, md)
    _chart(timeline, load_end)
    print(md)
    print(f"\nwrote {path} and results/autoscale.png")
    return result


def _chart(timeline, load_end) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .common import RESULTS

    rows = [r for r in timeline if r.get("replicas") is not None]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.step([r["t"] for r in rows], [r["replicas"] for r in rows], where="post", label="replicas")
    ax.plot([r["t"] for r in rows], [r["running"] + r["waiting"] for r in rows], label="running + waiting", alpha=0.6)
    ax.axvline(load_end, color="grey", linestyle="--", label="load ends")
    ax.set_xlabel("seconds")
    ax.legend()
    ax.set_title("autoscaling under load")
    fig.tight_layout()
    fig.savefig(RESULTS / "autoscale.png", dpi=120)

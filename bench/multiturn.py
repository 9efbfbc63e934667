"""Multi-turn chat against `pie serve` with the prefix cache on and off: time to first token per turn.

    python -m bench.serve --multi-turn [--conversations 8] [--turns 5] [--clients 4] [--max-tokens 64]
                                       [--rounds 2] [--dtype auto] [--inferlet text-completion]
                                       [--replicas N]

With --replicas N, the contenders are two deployments of N replicas of one thread, prefix cache on
in both: `--affinity on` (a conversation's turns to one replica) against `--affinity off` (power
of two choices), started one after the other each round (two local Ray clusters do not share a
machine), so a round's numbers are each deployment's first; results/multiturn-affinity.*.

Two `pie serve` subprocesses, `--prefix-caching on` and `--prefix-caching off`, each sent the same
conversations, one server at a time, interleaved (on, off, on, off, ...: a shared machine's speed
drifts). A conversation starts from a dev prompt; each later turn sends the whole conversation so
far (the assistant's earlier answers as it gave them) and one of FOLLOW_UPS. --clients
conversations run at once (streaming, greedy), each turn after the one before. Per turn and
server: TTFT p50/p90 (from sending the request), the prompt tokens computed (prompt tokens less
usage.prompt_tokens_details.cached_tokens); per server: tokens/s (completion tokens over wall
time); conversations lost (an error or no [DONE]) or mixed up (any turn's text unlike the same
turn's on the other server: greedy output must not depend on the cache). Writes
results/multiturn.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import queue
import threading
import time
from types import SimpleNamespace

import numpy as np

from .common import load_prompts, machine, table, write
from .serve import Server

FOLLOW_UPS = ["Tell me more about that.", "Can you give a concrete example?", "Why is that so?",
              "Summarize your answer in two sentences.", "What would you add?"]


def turn(http, model: str, messages: list[dict], max_tokens: int) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    sent, first, text, usage, done = time.perf_counter(), None, [], None, False
    with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            return {"error": f"{resp.status_code}: {resp.read()[:200]!r}"}
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                return {"error": chunk["error"]["message"]}
            usage = chunk.get("usage") or usage
            for c in chunk["choices"]:
                if c["delta"].get("content"):
                    first = first or time.perf_counter()
                    text.append(c["delta"]["content"])
    if not done or usage is None:
        return {"error": "the stream ended without [DONE] or usage"}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"text": "".join(text), "ttft_s": (first or time.perf_counter()) - sent, "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": cached, "completion_tokens": usage["completion_tokens"], "error": None}


def run_conversations(url: str, model: str, starts: list[str], turns: int, clients: int, max_tokens: int):
    """Every conversation, `clients` at a time; ([per conversation: its turns' results], wall seconds)."""
    import httpx

    todo: queue.Queue[int] = queue.Queue()
    for i in range(len(starts)):
        todo.put(i)
    out: list[list[dict]] = [[] for _ in starts]

    def client() -> None:
        with httpx.Client(base_url=url, timeout=httpx.Timeout(30, read=600)) as http:
            while True:
                try:
                    i = todo.get_nowait()
                except queue.Empty:
                    return
                messages = [{"role": "user", "content": starts[i]}]
                for t in range(turns):
                    try:
                        r = turn(http, model, messages, max_tokens)
                    except Exception as e:  # a lost request is a result here, not a crash
                        r = {"error": f"{type(e).__name__}: {e}"}
                    out[i].append(r)
                    if r["error"]:
                        break
                    messages += [{"role": "assistant", "content": r["text"]},
                                 {"role": "user", "content": FOLLOW_UPS[t % len(FOLLOW_UPS)]}]
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out, time.perf_counter() - t0


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--conversations", type=int, default=8, help="first N dev prompts, one conversation each")
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--inferlet", default="text-completion", help="pie serve --default-inferlet")
    ap.add_argument("--replicas", type=int, default=None, help="compare --affinity on/off over N replicas")
    args = ap.parse_args(argv)
    starts = [r["prompt"] for r in load_prompts(args.conversations)]
    if args.replicas:
        what, name = f"prefix affinity over {args.replicas} replicas", "multiturn-affinity"
        deploy = ["--replicas", str(args.replicas), "--threads-per-replica", "1", "--replica-cpus", "1"]
        modes = {m: deploy + ["--affinity", m] for m in ("on", "off")}
    else:
        what, name = "prefix cache", "multiturn"
        modes = {m: ["--prefix-caching", m] for m in ("on", "off")}
    servers: dict = {}
    runs: dict[str, list] = {m: [] for m in modes}
    walls = {m: 0.0 for m in modes}

    def start(m):
        servers[m] = Server(SimpleNamespace(dtype=args.dtype, model=args.model, inferlet=args.inferlet,
                                            extra=modes[m]), args.clients)
        if args.replicas:
            from .replicas import _wait_replicas

            _wait_replicas(servers[m], args.replicas)
        run_conversations(servers[m].url, servers[m].model, ["Hello"], 2, 1, 4)  # warm-up

    try:
        if not args.replicas:
            for m in modes:
                start(m)
        for r in range(args.rounds):
            for m in modes:
                if args.replicas:
                    start(m)
                got, wall = run_conversations(servers[m].url, servers[m].model, starts, args.turns, args.clients,
                                              args.max_tokens)
                if args.replicas:
                    servers.pop(m).stop()
                runs[m].append(got)
                walls[m] += wall
                print(f"round {r + 1}, {what} {m}: {wall:.1f} s", flush=True)
    finally:
        for s in servers.values():
            s.stop()
    result = summarize(runs, walls, args)
    result.update(machine=machine(), args=vars(args), prompts=starts, compared=what)
    md = report(result)
    write(name, result, md)
    chart(result, name)
    print(md)
    return result


def summarize(runs: dict, walls: dict, args) -> dict:
    per: dict = {}
    ref = runs["off"][0]
    mixed = lost = 0
    for m, rounds in runs.items():
        turns = []
        for t in range(args.turns):
            rs = [c[t] for got in rounds for c in got if len(c) > t and not c[t]["error"]]
            ttft = [r["ttft_s"] for r in rs]
            turns.append({"turn": t + 1, "requests": len(rs), "ttft_p50_s": float(np.percentile(ttft, 50)) if ttft else None,
                          "ttft_p90_s": float(np.percentile(ttft, 90)) if ttft else None,
                          "prompt_tokens": sum(r["prompt_tokens"] for r in rs),
                          "computed_tokens": sum(r["prompt_tokens"] - r["cached_tokens"] for r in rs)})
        tokens = sum(r["completion_tokens"] for got in rounds for c in got for r in c if not r["error"])
        per[m] = {"turns": turns, "tokens_per_s": tokens / walls[m], "wall_s": walls[m]}
        for got in rounds:
            for i, c in enumerate(got):
                if len(c) < args.turns or any(r["error"] for r in c):
                    lost += 1
                elif [r["text"] for r in c] != [r.get("text") for r in ref[i]]:
                    mixed += 1
    last = args.turns - 1
    ratio = per["on"]["turns"][last]["ttft_p50_s"] / per["off"]["turns"][last]["ttft_p50_s"]
    return {"benchmark": "multiturn", "servers": per, "lost": lost, "mixed": mixed, "last_turn_ttft_on_over_off": ratio}


def report(res: dict) -> str:
    a = res["args"]
    rows = []
    for t in range(a["turns"]):
        on, off = res["servers"]["on"]["turns"][t], res["servers"]["off"]["turns"][t]
        rows.append([t + 1, on["ttft_p50_s"] * 1e3, on["ttft_p90_s"] * 1e3, off["ttft_p50_s"] * 1e3,
                     off["ttft_p90_s"] * 1e3, on["ttft_p50_s"] / off["ttft_p50_s"], on["computed_tokens"],
                     off["computed_tokens"], on["requests"]])
    return (f"Multi-turn chat, pie serve ({a['inferlet']}, dtype {a['dtype']}), {res['compared']} on against off, "
            f"{a['conversations']} conversations "
            f"of {a['turns']} turns from the dev prompts, {a['clients']} at a time, max_tokens {a['max_tokens']}, "
            f"greedy, {a['rounds']} interleaved rounds per server. Machine: {res['machine']}.\n\n"
            + table(["turn", "on: TTFT p50 ms", "on: p90 ms", "off: TTFT p50 ms", "off: p90 ms", "on/off p50",
                     "on: prompt tokens computed", "off: computed", "requests"], rows)
            + f"\n\ntokens/s: on {res['servers']['on']['tokens_per_s']:.1f}, off {res['servers']['off']['tokens_per_s']:.1f}; "
            f"conversations lost {res['lost']}, mixed up {res['mixed']}.")


def chart(res: dict, name: str = "multiturn") -> None:
    from .common import bar_chart

    turns = [str(t["turn"]) for t in res["servers"]["on"]["turns"]]
    bar_chart(name, [f"turn {t}" for t in turns],
              {f"{res['compared']} {m}": [t["ttft_p50_s"] * 1e3 for t in res["servers"][m]["turns"]]
               for m in ("on", "off")},
              "TTFT p50 (ms)", title=f"multi-turn chat: time to first token per turn, {res['compared']}")


if __name__ == "__main__":
    main()

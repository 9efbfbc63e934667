"""`n` samples of one prompt: time to first token with n=4 against n=1, with the prefix cache and without.

    python -m bench.choices [--prompt-tokens 700] [--n 4] [--repeats 3] [--max-tokens 8]

Starts two `pie serve` subprocesses, `--prefix-caching on` and `--prefix-caching off`, and sends each
the same streamed completions (token-id prompts of --prompt-tokens tokens cut from the dev prompts'
chat texts, temperature 1, seeded) with n=1 and with n=--n, interleaved (on n=1, on n=4, off n=1,
off n=4, then the next repeat). Every request's prompt starts at another place of that text, so no
request finds blocks an earlier one left in the cache: what the cache saves is the request's own
samples' prefill. Per case: time to the first text of any choice (TTFT) and to the first text of
every choice (when the last sample starts streaming: what n costs), the medians over the repeats,
each over n=1's TTFT on the same server. Writes results/choices.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from types import SimpleNamespace

from .common import bar_chart, load_prompts, machine, table, write
from .serve import Server


def stream(url: str, model: str, ids: list[int], n: int, max_tokens: int) -> dict:
    """One streamed completion: seconds to the first text of any choice, and of every choice."""
    import httpx

    body = {"model": model, "prompt": ids, "n": n, "max_tokens": max_tokens, "temperature": 1.0, "seed": 1,
            "stream": True, "stream_options": {"include_usage": True}}
    first: dict[int, float] = {}
    usage = None
    t0 = time.perf_counter()
    with httpx.Client(base_url=url, timeout=600) as http, http.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{resp.status_code}: {resp.read()[:200]!r}")
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            usage = chunk.get("usage") or usage
            for c in chunk["choices"]:
                if c.get("text"):
                    first.setdefault(c["index"], time.perf_counter() - t0)
    if len(first) != n:
        raise RuntimeError(f"{n - len(first)} of {n} choices wrote no text")
    return {"ttft_s": min(first.values()), "all_first_s": max(first.values()),
            "cached_tokens": (usage or {}).get("prompt_tokens_details", {}).get("cached_tokens", 0)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompt-tokens", type=int, default=700)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--inferlet", default="text-completion", help="pie serve --default-inferlet")
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from host import store

    tok = AutoTokenizer.from_pretrained(store.read_record(args.model or store.DEFAULT_MODEL).path)
    text = " ".join(r["prompt"] for r in load_prompts())
    pool = tok.encode(text, add_special_tokens=False)
    step = 37  # every request starts elsewhere in the text: no request finds another's blocks
    need = 4 * args.repeats * step + args.prompt_tokens
    if len(pool) < need:
        pool = (pool * (need // len(pool) + 1))[:need]
    cases = [("on", 1), ("on", args.n), ("off", 1), ("off", args.n)]
    servers = {}
    got: dict[tuple[str, int], list[dict]] = {c: [] for c in cases}
    try:
        for mode in ("on", "off"):
            servers[mode] = Server(SimpleNamespace(dtype="auto", model=args.model, inferlet=args.inferlet,
                                                   extra=["--prefix-caching", mode]), args.n)
        for s in servers.values():  # warm-up: compiled components, first-call costs
            stream(s.url, s.model, pool[-args.prompt_tokens:], args.n, 2)
        k = 0
        for r in range(args.repeats):
            for mode, n in cases:
                ids = pool[k * step:k * step + args.prompt_tokens]
                k += 1
                out = stream(servers[mode].url, servers[mode].model, ids, n, args.max_tokens)
                got[(mode, n)].append(out)
                print(f"repeat {r + 1}, prefix cache {mode}, n={n}: TTFT {out['ttft_s']:.3f} s, every choice "
                      f"{out['all_first_s']:.3f} s, cached {out['cached_tokens']}", flush=True)
    finally:
        for s in servers.values():
            s.stop()
    med = {c: {key: statistics.median(o[key] for o in got[c]) for key in ("ttft_s", "all_first_s", "cached_tokens")}
           for c in cases}
    for mode in ("on", "off"):
        med[(mode, args.n)]["ttft_vs_n1"] = med[(mode, args.n)]["ttft_s"] / med[(mode, 1)]["ttft_s"]
        med[(mode, args.n)]["all_first_vs_n1"] = med[(mode, args.n)]["all_first_s"] / med[(mode, 1)]["ttft_s"]
    result = {"benchmark": "choices", "prompt_tokens": args.prompt_tokens, "n": args.n, "repeats": args.repeats,
              "max_tokens": args.max_tokens, "inferlet": args.inferlet, "machine": machine(),
              "cases": {f"prefix cache {m}, n={n}": {"median": med[(m, n)], "runs": got[(m, n)]} for m, n in cases}}
    rows = [[f"prefix cache {m}, n={n}", med[(m, n)]["ttft_s"], med[(m, n)]["all_first_s"],
             med[(m, n)].get("ttft_vs_n1", 1.0), med[(m, n)].get("all_first_vs_n1", 1.0),
             int(med[(m, n)]["cached_tokens"])] for m, n in cases]
    md = (f"# `n` samples of a {args.prompt_tokens}-token prompt: time to first token\n\n"
          f"`python -m bench.choices --prompt-tokens {args.prompt_tokens} --n {args.n} --repeats {args.repeats}`, "
          f"{args.inferlet}, medians of {args.repeats} interleaved repeats\n\n"
          + table(["case", "TTFT s", "every choice's first text s", "TTFT / n=1's",
                   "every choice's / n=1's TTFT", "cached tokens"], rows))
    path = write("choices", result, md)
    bar_chart("choices", [f"n={n}" for n in (1, args.n)],
              {f"prefix cache {m}": [med[(m, n)]["all_first_s"] for n in (1, args.n)] for m in ("on", "off")},
              "seconds", title=f"every choice's first text, {args.prompt_tokens}-token prompt")
    print(md)
    print(f"\nwrote {path} and results/choices.png")
    return result


if __name__ == "__main__":
    main()

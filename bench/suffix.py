"""Cross-request drafts (the suffix index): cacheback drafting from earlier requests' texts against
cacheback without them and plain decoding, on traffic that repeats itself.

    python -m bench.suffix [--prompts 46] [--max-tokens 128] [--dtype float32] [--workloads regenerate,rephrase,template]

In process (one engine, prefix caching off so that no contender's prompt pass is cheaper for
coming later), greedy, `--chat`. Workloads, each in a namespace of its own:

- regenerate: the dev prompts were answered once (text-completion, not timed); each is asked again
  (a client retrying, or n independent requests for the same prompt).
- rephrase: the same first answers; each prompt is asked again with another instruction before it
  ("Answer the following. ..."), so the answer overlaps the first in part.
- template: TEMPLATE_TASKS, one templated code task after another: each request can draft only
  from the requests before it (agents re-emitting the same scaffolding).

Per prompt the contenders run one after another, interleaved, each in a namespace of its own that
holds the same earlier texts (the first answers, copied into each; and its own earlier answers,
which are the same for every contender), so that none drafts from another's answer to the prompt. Greedy outputs are checked identical. Per workload: decode tokens/s of each
(total tokens / total wall time), its ratio to text-completion's, and cacheback's accepted drafts
per verify pass. Writes results/suffix.{json,md,png}.
"""

from __future__ import annotations

import argparse
import time

from .common import bar_chart, geomean, load_prompts, machine, table, write

REPHRASE = "Answer the following. {prompt}"
TEMPLATE = ("Write a Python function `{name}` that {task}. Give it type hints and a docstring, then show "
            "one example call in a `if __name__ == \"__main__\":` block.")
TEMPLATE_TASKS = [
    ("count_vowels", "counts the vowels in a string"), ("reverse_words", "reverses the order of words in a sentence"),
    ("is_palindrome", "checks whether a string is a palindrome"), ("fizzbuzz", "returns the FizzBuzz list up to n"),
    ("flatten", "flattens a nested list of integers"), ("word_count", "counts how often each word occurs in a text"),
    ("fibonacci", "returns the first n Fibonacci numbers"), ("is_prime", "checks whether an integer is prime"),
    ("celsius_to_fahrenheit", "converts a temperature from Celsius to Fahrenheit"),
    ("max_subarray", "returns the largest sum of a contiguous subarray"), ("dedupe", "removes duplicates from a list, keeping order"),
    ("chunk", "splits a list into chunks of size n"), ("capitalize_words", "capitalizes the first letter of every word"),
    ("gcd", "returns the greatest common divisor of two integers"), ("median", "returns the median of a list of numbers"),
    ("anagrams", "checks whether two strings are anagrams"),
]
CONTENDERS = ("suffix", "no-suffix", "text-completion")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompts", type=int, default=46, help="dev prompts for regenerate and rephrase")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--workloads", default="regenerate,rephrase,template")
    args = ap.parse_args(argv)
    from host import store
    from host.paths import resolve_inferlet
    from host.runtime import Runtime

    engine = store.open_engine(args.model, device="auto", dtype=args.dtype, kv_pages=1024, prefix_caching=False)
    wasm = {"cacheback": resolve_inferlet("cacheback-speculative-decoding"), "text-completion": resolve_inferlet("text-completion")}
    dev = [p["prompt"] for p in load_prompts(args.prompts)]
    workloads = [w for w in args.workloads.split(",") if w]
    results: dict = {"machine": machine(), "args": vars(args), "workloads": {}}
    with Runtime(engine) as rt:
        def run(which, prompt, namespace, *extra):
            t = time.perf_counter()
            r = rt.run(wasm[which], ["--prompt", prompt, "--chat", "--max-tokens", str(args.max_tokens), *extra],
                       name=which, namespace=namespace)
            if not r.ok:
                raise RuntimeError(f"{which}: {r.error}")
            return r, time.perf_counter() - t

        run("cacheback", "Hello", "warm-up")  # compiles the components, warms the kernels
        run("text-completion", "Hello", "warm-up")
        for w in workloads:
            ns = {c: f"bench-{w}-{c}" for c in CONTENDERS}
            if w in ("regenerate", "rephrase"):
                for p in dev:  # the earlier requests: not timed
                    run("text-completion", p, f"bench-{w}")
                for doc in engine.suffix.index(f"bench-{w}").documents():
                    for c in CONTENDERS:
                        engine.suffix.index(ns[c]).insert(doc)
                prompts = dev if w == "regenerate" else [REPHRASE.format(prompt=p) for p in dev]
            elif w == "template":
                prompts = [TEMPLATE.format(name=n, task=t) for n, t in TEMPLATE_TASKS]
            else:
                raise SystemExit(f"unknown workload {w!r}")
            rows = []
            for i, p in enumerate(prompts):
                got = {"suffix": run("cacheback", p, ns["suffix"], "--suffix-draft", "1"),
                       "no-suffix": run("cacheback", p, ns["no-suffix"], "--suffix-draft", "0"),
                       "text-completion": run("text-completion", p, ns["text-completion"])}
                ref = got["text-completion"][0].token_ids
                if any(r.token_ids != ref for r, _ in got.values()):
                    raise RuntimeError(f"{w} prompt {i}: greedy outputs differ")
                rows.append({c: {"tokens": len(r.token_ids), "seconds": s, "passes": r.stats["passes"],
                                 "accepted": r.stats["accepted_tokens"], "drafted": r.stats["drafted_tokens"]}
                             for c, (r, s) in got.items()})
                print(f"{w} {i + 1}/{len(prompts)}: " + ", ".join(f"{c} {rows[-1][c]['seconds']:.2f}s" for c in CONTENDERS),
                      flush=True)
            results["workloads"][w] = summarize(rows)
    md = report(results)
    write("suffix", results, md)
    ws = list(results["workloads"])
    bar_chart("suffix", ws, {c: [results["workloads"][w][c]["vs_plain"] for w in ws] for c in CONTENDERS},
              "decode speed / text-completion's", title="cacheback with and without cross-request drafts")
    print(md)
    return results


def summarize(rows: list[dict]) -> dict:
    out = {}
    for c in CONTENDERS:
        toks = sum(r[c]["tokens"] for r in rows)
        secs = sum(r[c]["seconds"] for r in rows)
        passes = sum(r[c]["passes"] for r in rows)
        out[c] = {"tokens": toks, "seconds": secs, "tokens_per_s": toks / secs, "passes": passes,
                  "accepted": sum(r[c]["accepted"] for r in rows), "drafted": sum(r[c]["drafted"] for r in rows),
                  "tokens_per_pass": toks / max(passes, 1)}
    plain = out["text-completion"]["tokens_per_s"]
    for c in CONTENDERS:
        out[c]["vs_plain"] = out[c]["tokens_per_s"] / plain
        out[c]["geomean_vs_plain"] = geomean([r["text-completion"]["seconds"] / r[c]["seconds"] for r in rows])
    out["prompts"] = len(rows)
    return out


def report(results: dict) -> str:
    m = results["machine"]
    lines = [f"# Cross-request drafts (bench.suffix)\n\n{m}\n\nArguments: {results['args']}\n"]
    rows = []
    for w, s in results["workloads"].items():
        for c in CONTENDERS:
            rows.append([w, s["prompts"], c, s[c]["tokens_per_s"], s[c]["vs_plain"], s[c]["geomean_vs_plain"],
                         s[c]["tokens_per_pass"], f"{s[c]['accepted']}/{s[c]['drafted']}"])
    lines.append(table(["workload", "prompts", "contender", "tokens/s", "vs plain (total)", "vs plain (geomean)",
                        "tokens per pass", "accepted/drafted"], rows))
    return "\n".join(lines)


if __name__ == "__main__":
    main()

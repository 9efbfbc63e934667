"""text-completion through WebAssembly against HF `generate` greedy, and the host's cost per round.

    python -m bench.loop_overhead [--prompts 8] [--new-tokens 128] [--dtype auto]

Runs each prompt (chat template) through HF generate greedy, text-completion --loop guest
(one guest-driven pass per token) and --loop device (the epilogue drives the loop), side by
side in one process. Host overhead per round = (run wall time - engine model time) / rounds:
everything that is not the model call (guest code, crossings, scheduling, epilogues, readback).
"""

from __future__ import annotations

import argparse
import statistics

from host import store

from .common import chat_ids, load_hf, load_prompts, machine, table, write
from .spec import hf_run


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args(argv)

    from host.runtime.cli import resolve_inferlet
    from host.runtime.runtime import Runtime

    engine = store.open_engine(args.model, dtype=args.dtype, kv_pages=1024)
    hf = load_hf(engine)
    tok = engine.tokenizer
    wasm = resolve_inferlet("text-completion")
    rows = load_prompts(args.prompts)
    n = args.new_tokens
    modes = ["guest", "device"]
    per = []
    with Runtime(engine) as rt:
        for m in modes:
            rt.run(wasm, ["--prompt", "Hi", "--chat", "--max-tokens", "4", "--loop", m], name="text-completion")
        hf_run(hf, tok, chat_ids(tok, "Hi"), 4)
        for r in rows:
            ids = chat_ids(tok, r["prompt"])
            ref, t_hf = hf_run(hf, tok, ids, n)
            rec = {"id": r["id"], "category": r["category"], "hf_tps": len(ref) / t_hf}
            for m in modes:
                runs = []
                for max_tokens in (1, n):
                    m0 = engine.model_time_s
                    res = rt.run(wasm, ["--prompt", r["prompt"], "--chat", "--max-tokens", str(max_tokens),
                                        "--loop", m], name="text-completion")
                    runs.append((res, res.stats["wall_s"] - (engine.model_time_s - m0)))
                (one, host1), (res, host_n) = runs
                s = res.stats
                rec[m] = {"tps": len(res.token_ids) / s["wall_s"], "same": res.token_ids == ref,
                          "overhead_us_per_round": (host_n - host1) / max(s["passes"] - one.stats["passes"], 1) * 1e6,
                          "guest_calls_per_token": s["guest_calls"] / max(len(res.token_ids), 1)}
            per.append(rec)
            print(f"prompt {r['id']}: hf {rec['hf_tps']:.1f} guest {rec['guest']['tps']:.1f} device "
                  f"{rec['device']['tps']:.1f} tok/s; overhead guest {rec['guest']['overhead_us_per_round']:.0f} us, "
                  f"device {rec['device']['overhead_us_per_round']:.0f} us per round", flush=True)
    med = lambda f: statistics.median(f(x) for x in per)  # noqa: E731
    summary = {m: {"tps_median": med(lambda x: x[m]["tps"]), "ratio_vs_hf": med(lambda x: x[m]["tps"] / x["hf_tps"]),
                   "overhead_us_per_round_median": med(lambda x: x[m]["overhead_us_per_round"]),
                   "guest_calls_per_token_median": med(lambda x: x[m]["guest_calls_per_token"]),
                   "identical_to_hf": all(x[m]["same"] for x in per)} for m in modes}
    summary["hf"] = {"tps_median": med(lambda x: x["hf_tps"])}
    result = {"benchmark": "loop_overhead", "model": engine.info.name, "dtype": engine.info.dtype,
              "device": engine.info.device, "prompts": [r["id"] for r in rows], "new_tokens": n,
              "machine": machine(), "summary": summary, "per_prompt": per}
    md = (f"text-completion vs HF generate greedy, {engine.info.name} {engine.info.dtype} on {engine.info.device}, "
          f"dev prompts {result['prompts']}, chat template, {n} new tokens (medians)\n\n"
          + table(["contender", "tok/s", "tok/s vs HF", "host overhead us/round", "guest calls/token", "same tokens as HF"],
                  [["HF generate greedy", summary["hf"]["tps_median"], 1.0, "", "", ""]]
                  + [[f"text-completion --loop {m}", summary[m]["tps_median"], summary[m]["ratio_vs_hf"],
                      summary[m]["overhead_us_per_round_median"], summary[m]["guest_calls_per_token_median"],
                      summary[m]["identical_to_hf"]] for m in modes]))
    path = write("loop_overhead", result, md)
    print(md)
    print(f"\nwrote {path}")
    return result


if __name__ == "__main__":
    main()

"""text-completion through WebAssembly against HF `generate` greedy, and the host's cost per round.

    python -m bench.loop_overhead [--prompts 8] [--new-tokens 128] [--dtype auto]

Runs each prompt (chat template) through HF generate greedy, text-completion --loop guest
(one guest-driven pass per token) and --loop device (the epilogue drives the loop), side by
side in one process. Host overhead per round = (run wall time - engine model time) / rounds:
everything that is not the model call (guest code, crossings, scheduling, epilogues, readback).

The runs have no streaming client, so their text is decoded once at the end; the device loop is
also measured streaming its text as it goes (a detokeniser step per round on the compute thread).
It is also measured for the device loop with the model call replayed (its last one-row output
returned again, no model run): the host's own work with warm caches. A model call streams the
whole model's weights through the CPU caches, so the host code after it runs several times slower
than the same code run back to back; the two figures separate that from the work itself.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics

from host import store

from .common import chat_ids, load_hf, load_prompts, machine, table, write
from .spec import hf_run


@contextlib.contextmanager
def replayed_model(engine):
    """engine.run returns its last one-row output again instead of running the model (longer
    batches, prefills, still run). An instance attribute over the method, for this block only."""
    real, last = engine.run, {}

    def run(batch):
        if batch.input_ids.shape[0] != 1 or "out" not in last:
            outs = real(batch)
            if batch.input_ids.shape[0] == 1:
                last["out"] = outs
            return outs
        return last["out"]
    engine.run = run
    try:
        yield
    finally:
        del engine.run


def _us(x) -> str:
    return "n/a" if x is None else f"{x:.0f}"


def overhead(rt, wasm, engine, prompt: str, mode: str, n: int, on_text=None):
    """(result of the n-token run, host overhead per round in us): two runs, 2 and n tokens, so
    the prompt's pass, the loop's start and the guest's start and end cancel out."""
    runs = []
    for max_tokens in (2, n):
        m0 = engine.model_time_s
        res = rt.run(wasm, ["--prompt", prompt, "--chat", "--max-tokens", str(max_tokens), "--loop", mode],
                     name="text-completion", on_text=on_text, prefix_caching=False)
        runs.append((res, res.stats["wall_s"] - (engine.model_time_s - m0)))
    (short, host_short), (res, host_n) = runs
    extra = res.stats["passes"] - short.stats["passes"]  # none if the answer is at most two tokens long
    return res, (host_n - host_short) / extra * 1e6 if extra > 0 else None


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args(argv)

    from host.paths import resolve_inferlet
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
                res, host = overhead(rt, wasm, engine, r["prompt"], m, n)
                s = res.stats
                rec[m] = {"tps": len(res.token_ids) / s["wall_s"], "same": res.token_ids == ref,
                          "overhead_us_per_round": host,
                          "guest_calls_per_token": s["guest_calls"] / max(len(res.token_ids), 1)}
            rec["device_streaming_overhead_us_per_round"] = overhead(
                rt, wasm, engine, r["prompt"], "device", n, on_text=lambda text: None)[1]
            with replayed_model(engine):
                rec["device_warm_overhead_us_per_round"] = overhead(rt, wasm, engine, r["prompt"], "device", n)[1]
            per.append(rec)
            print(f"prompt {r['id']}: hf {rec['hf_tps']:.1f} guest {rec['guest']['tps']:.1f} device "
                  f"{rec['device']['tps']:.1f} tok/s; overhead guest {_us(rec['guest']['overhead_us_per_round'])} us, "
                  f"device {_us(rec['device']['overhead_us_per_round'])} us per round "
                  f"({_us(rec['device_streaming_overhead_us_per_round'])} us streaming, "
                  f"{_us(rec['device_warm_overhead_us_per_round'])} us with the model call replayed)", flush=True)
    def med(f):
        xs = [v for v in map(f, per) if v is not None]  # None: a one-token answer has no rounds
        return statistics.median(xs) if xs else None

    summary = {m: {"tps_median": med(lambda x: x[m]["tps"]), "ratio_vs_hf": med(lambda x: x[m]["tps"] / x["hf_tps"]),
                   "overhead_us_per_round_median": med(lambda x: x[m]["overhead_us_per_round"]),
                   "guest_calls_per_token_median": med(lambda x: x[m]["guest_calls_per_token"]),
                   "identical_to_hf": all(x[m]["same"] for x in per)} for m in modes}
    summary["hf"] = {"tps_median": med(lambda x: x["hf_tps"])}
    summary["device_streaming"] = {"overhead_us_per_round_median": med(lambda x: x["device_streaming_overhead_us_per_round"])}
    summary["device_warm"] = {"overhead_us_per_round_median": med(lambda x: x["device_warm_overhead_us_per_round"])}
    result = {"benchmark": "loop_overhead", "model": engine.info.name, "dtype": engine.info.dtype,
              "device": engine.info.device, "prompts": [r["id"] for r in rows], "new_tokens": n,
              "machine": machine(), "summary": summary, "per_prompt": per}
    md = (f"text-completion vs HF generate greedy, {engine.info.name} {engine.info.dtype} on {engine.info.device}, "
          f"dev prompts {result['prompts']}, chat template, {n} new tokens (medians)\n\n"
          + table(["contender", "tok/s", "tok/s vs HF", "host overhead us/round", "guest calls/token", "same tokens as HF"],
                  [["HF generate greedy", summary["hf"]["tps_median"], 1.0, "", "", ""]]
                  + [[f"text-completion --loop {m}", summary[m]["tps_median"], summary[m]["ratio_vs_hf"],
                      summary[m]["overhead_us_per_round_median"], summary[m]["guest_calls_per_token_median"],
                      summary[m]["identical_to_hf"]] for m in modes]
                  + [["text-completion --loop device, streaming its text", "", "",
                      summary["device_streaming"]["overhead_us_per_round_median"], "", ""]]
                  + [["text-completion --loop device, model call replayed (warm caches)", "", "",
                      summary["device_warm"]["overhead_us_per_round_median"], "", ""]]))
    path = write("loop_overhead", result, md)
    print(md)
    print(f"\nwrote {path}")
    return result


if __name__ == "__main__":
    main()

"""The epilogue's own time per round, in real device loops: text-completion and cacheback.

    python -m bench.epilogue_round [--prompts 4] [--new-tokens 64] [--repeats 2]

Runs text-completion (device loop, greedy) and cacheback-speculative-decoding (greedy, and
sampled at temperature 0.8) on the dev prompts (chat template) through the real runtime and
engine, and times every call of the executor (`CompiledProgram.run`) from the scheduler: the epilogue's
host work right after a model call, as a loop pays it. Reports the median microseconds per call
per prompt, then the median over prompts; the faster of --repeats runs counts for each prompt.
"""

from __future__ import annotations

import argparse
import statistics
import time

from host import store

from .common import load_prompts, machine, table, write

CONTENDERS = [("text-completion", "text-completion", []),
              ("cacheback greedy", "cacheback-speculative-decoding", []),
              ("cacheback T=0.8", "cacheback-speculative-decoding", ["--temperature", "0.8", "--seed", "1"])]


class Timer:
    """CompiledProgram.run wrapped: each call's wall time, while `on`."""

    def __init__(self):
        from host.epilogue.compile import CompiledProgram
        self.cls, self.real, self.times, self.on = CompiledProgram, CompiledProgram.run, [], False
        timer = self

        def run(prog, envs, *a, **k):
            t0 = time.perf_counter()
            try:
                return timer.real(prog, envs, *a, **k)
            finally:
                if timer.on:
                    timer.times.append(time.perf_counter() - t0)
        CompiledProgram.run = run

    def close(self):
        self.cls.run = self.real


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--tag", default="", help="a label for this code version in the result file's name")
    args = ap.parse_args(argv)

    from host.paths import resolve_inferlet
    from host.runtime.runtime import Runtime

    engine = store.open_engine(args.model, kv_pages=1024)
    rows = load_prompts(args.prompts)
    timer = Timer()
    per = []
    try:
        with Runtime(engine) as rt:
            for _, inferlet, extra in CONTENDERS:  # warm-up: compile components and programs
                rt.run(resolve_inferlet(inferlet), ["--prompt", "Hi", "--chat", "--max-tokens", "4", *extra], name=inferlet)
            for r in rows:
                rec = {"id": r["id"]}
                for label, inferlet, extra in CONTENDERS:
                    best = None
                    for _ in range(args.repeats):
                        timer.times, timer.on = [], True
                        res = rt.run(resolve_inferlet(inferlet), ["--prompt", r["prompt"], "--chat", "--max-tokens",
                                                                  str(args.new_tokens), *extra], name=inferlet,
                                     prefix_caching=False)
                        timer.on = False
                        us = statistics.median(timer.times) * 1e6 if timer.times else None
                        if us is not None and (best is None or us < best["us_per_round"]):
                            best = {"us_per_round": us, "rounds": len(timer.times), "tokens": len(res.token_ids)}
                    rec[label] = best
                per.append(rec)
                print(f"prompt {r['id']}: " + ", ".join(
                    f"{lb} {rec[lb]['us_per_round']:.0f} us ({rec[lb]['rounds']} rounds)" for lb, _, _ in CONTENDERS
                    if rec[lb]), flush=True)
    finally:
        timer.close()
    summary = {lb: statistics.median([x[lb]["us_per_round"] for x in per if x[lb]]) for lb, _, _ in CONTENDERS}
    result = {"benchmark": "epilogue_round", "tag": args.tag, "model": engine.info.name, "dtype": engine.info.dtype,
              "device": engine.info.device, "prompts": [r["id"] for r in rows], "new_tokens": args.new_tokens,
              "machine": machine(), "summary_us_per_round": summary, "per_prompt": per}
    md = (f"epilogue time per round (CompiledProgram.run, after real model calls), {engine.info.name} {engine.info.dtype} on "
          f"{engine.info.device}, dev prompts {result['prompts']}, {args.new_tokens} new tokens, median over prompts "
          f"of each prompt's median{' [' + args.tag + ']' if args.tag else ''}\n\n"
          + table(["contender", "epilogue us/round"], [[lb, summary[lb]] for lb, _, _ in CONTENDERS]))
    path = write("epilogue_round" + (f"-{args.tag}" if args.tag else ""), result, md)
    print(md)
    print(f"\nwrote {path}")
    return result


if __name__ == "__main__":
    main()

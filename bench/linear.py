"""Whole-model pass time by window length, the decoder's linear layers stock vs packed.

    python -m bench.linear [--model NAME] [--windows 1 2 4 8 16] [--context 300]

One working set holds a prefix of --context tokens; each case runs a pass of W rows (all read
out, fold 0, so the context stays the same) with the engine's packed linears off and on,
interleaved, and reports the median of --repeats. A batch of 8 one-row passes (8 working
sets) is the batched-decode case. Also checks both paths give the same logits to tolerance.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from host import store
from host.engine.engine import Pass

from .common import machine, on_compute, table, write


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--windows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args(argv)
    return on_compute(_run, args)  # all model work on the compute thread, as in the engine


def _run(args) -> dict:
    pages = 8 * -(-(args.context + max(args.windows)) // 16) + 64  # 8 working sets of context + window
    engine = store.open_engine(args.model, kv_pages=max(256, pages))
    if not engine.linears.count:
        raise SystemExit(f"the packed path does not apply here ({engine.info.dtype} on {engine.info.device})")
    prefix = [(7 * i) % 1000 + 100 for i in range(args.context)]
    sets = [engine.new_working_set() for _ in range(8)]
    engine.forward([Pass(ws, prefix, [0]) for ws in sets])

    cases = {f"{w} rows": [Pass(sets[0], prefix[:w], list(range(w)), fold=0)] for w in args.windows}
    cases["8 x 1 row"] = [Pass(ws, prefix[:1], [0], fold=0) for ws in sets]

    def once(passes, on: bool):
        engine.linears.enabled = on
        t0 = time.perf_counter()
        outs = engine.forward(passes)
        return time.perf_counter() - t0, torch.cat([o.logits for o in outs])

    times = {(c, on): [] for c in cases for on in (False, True)}
    diff = {}
    for name, passes in cases.items():  # warm both paths and compare their logits
        diff[name] = (once(passes, False)[1] - once(passes, True)[1]).abs().max().item()
    for _ in range(args.repeats):
        for name, passes in cases.items():
            for on in (False, True):
                times[(name, on)].append(once(passes, on)[0])
    engine.linears.enabled = True
    rows = []
    one = statistics.median(times[(f"{args.windows[0]} rows", True)])
    for name in cases:
        off, on = (statistics.median(times[(name, x)]) * 1e3 for x in (False, True))
        rows.append({"case": name, "stock_ms": off, "packed_ms": on, "speedup": off / on,
                     "packed_vs_first": on / (one * 1e3), "max_abs_logit_diff": diff[name]})
    md = (f"Model pass time, {engine.info.name} ({engine.info.dtype}, {engine.info.device}), context "
          f"{args.context}, median ms of {args.repeats}; {engine.linears.count} linear layers\n\n"
          + table(["case", "stock linear ms", "packed ms", "speedup", f"packed / {args.windows[0]} row",
                   "max |logit diff|"],
                  [[r["case"], r["stock_ms"], r["packed_ms"], r["speedup"], r["packed_vs_first"],
                    f"{r['max_abs_logit_diff']:.1e}"] for r in rows]))
    path = write("linear", {"benchmark": "linear", "model": engine.info.name, "machine": machine(),
                            "context": args.context, "rows": rows}, md)
    print(md)
    print(f"\nwrote {path}")
    return {"rows": rows}


if __name__ == "__main__":
    main()

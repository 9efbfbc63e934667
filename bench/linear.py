"""Whole-model pass time by window length, with each of the decoder's product paths.

    python -m bench.linear [--model NAME] [--windows 1 2 4 8 16 32 48 64] [--context 300]

One working set holds a prefix of --context tokens; each case runs a pass of W rows (all read
out, fold 0, so the context stays the same) with the products stock (MKL's `linear`), packed
for oneDNN at every row count, and packed as the engine runs them (host/engine/linear.py:
skinny_linear, or block_linear over a file's blocks, at every row count), interleaved, and reports the median of
--repeats. A batch of 8 one-row passes (8 working sets) is the batched-decode case. The readout
(lm_head) takes the same path as the layers. Also checks the paths give the same logits to
tolerance. The roofline beside it: the multiply-adds a read-out row costs (every linear's
inputs x outputs, the readout's included), this CPU's float32 vector multiply-add peak on the
compute threads (bench/fma_peak.cpp, built for this machine), and so the least a row can add to
a pass, against what each window's rows past the first add (engine path). Writes JSON and a
table to results/.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from host import store
from host.engine.engine import Pass

from .common import ProductPaths, machine, on_compute, table, write

PATHS = ProductPaths.NAMES


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--windows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 256])
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args(argv)
    return on_compute(_run, args)  # all model work on the compute thread, as in the engine


def _run(args) -> dict:
    pages = 8 * -(-(args.context + max(args.windows)) // 16) + 64  # 8 working sets of context + window
    engine = store.open_engine(args.model, kv_pages=max(256, pages))
    if not engine.linears.count:
        raise SystemExit(f"the packed path does not apply here ({engine.info.dtype} on {engine.info.device})")
    prefix = [(7 * i) % 1000 + 100 for i in range(max(args.context, *args.windows))]
    sets = [engine.new_working_set() for _ in range(8)]
    engine.forward([Pass(ws, prefix[:args.context], [0]) for ws in sets])

    cases = {f"{w} rows": [Pass(sets[0], prefix[:w], list(range(w)), fold=0)] for w in args.windows}
    width = {f"{w} rows": w for w in args.windows}  # a one-pass case's rows
    cases["8 x 1 row"] = [Pass(ws, prefix[:1], [0], fold=0) for ws in sets]
    products = ProductPaths(engine)

    def once(passes, path: str):
        with products.use(path):
            t0 = time.perf_counter()
            outs = engine.forward(passes)
            dt = time.perf_counter() - t0
        return dt, torch.cat([o.logits for o in outs])

    times = {(c, p): [] for c in cases for p in PATHS}
    diff = {}
    for name, passes in cases.items():  # warm every path and compare their logits with stock's
        stock = once(passes, "stock")[1]
        diff[name] = max((once(passes, p)[1] - stock).abs().max().item() for p in PATHS[1:])
    for _ in range(args.repeats):
        for name, passes in cases.items():
            for p in PATHS:
                times[(name, p)].append(once(passes, p)[0])
    rows = []
    one = statistics.median(times[(f"{args.windows[0]} rows", "engine")]) * 1e3
    roof = roofline(engine)
    for name in cases:
        stock, dnn, ours = (statistics.median(times[(name, p)]) * 1e3 for p in PATHS)
        w = width.get(name, 0)
        extra = (ours - one) / (w - args.windows[0]) if w > args.windows[0] else None
        rows.append({"case": name, "stock_ms": stock, "onednn_ms": dnn, "engine_ms": ours,
                     "onednn_over_engine": dnn / ours, "engine_vs_first": ours / one, "max_abs_logit_diff": diff[name],
                     "engine_ms_a_row_past_first": extra})
    md = (f"Model pass time, {engine.info.name} ({engine.info.dtype}, {engine.info.device}), context "
          f"{args.context}, median ms of {args.repeats}, paths interleaved; {engine.linears.count} linear layers; "
          "engine: skinny_linear / block_linear at every row count\n\n"
          + table(["case", "stock ms", "oneDNN ms", "engine ms", "oneDNN / engine", f"engine / {args.windows[0]} row",
                   "max |logit diff|"],
                  [[r["case"], r["stock_ms"], r["onednn_ms"], r["engine_ms"], r["onednn_over_engine"],
                    r["engine_vs_first"], f"{r['max_abs_logit_diff']:.1e}"] for r in rows])
          + f"\n\nRoofline: a read-out row is {roof['macs_a_row'] / 1e6:.1f}M multiply-adds; this CPU's float32 "
          f"peak is {roof['fma_per_s'] / 1e9:.2f}G {roof['lanes']}-lane FMAs a second on {roof['threads']} threads, "
          f"so a row adds at least {roof['floor_ms_a_row']:.2f} ms. What a row past the first added (engine): "
          + ", ".join(f"{r['case']} {r['engine_ms_a_row_past_first']:.2f} ms"
                      for r in rows if r["engine_ms_a_row_past_first"] is not None) + ".")
    path = write("linear", {"benchmark": "linear", "model": engine.info.name, "machine": machine(),
                            "context": args.context, "rows": rows, "roofline": roof}, md)
    print(md)
    print(f"\nwrote {path}")
    return {"rows": rows}


def roofline(engine) -> dict:
    """The multiply-adds of one read-out row (the model's linears, readout included) and this
    CPU's float32 vector multiply-add peak on the compute threads: the least a row adds."""
    from torch.utils.cpp_extension import load

    macs = sum(m.in_features * m.out_features for m in engine.model.modules()
               if hasattr(m, "in_features") and hasattr(m, "out_features") and not list(m.children()))
    peak = load("pie_bench_fma_peak", [str(Path(__file__).with_name("fma_peak.cpp"))],
                extra_cflags=["-O2", "-march=native"], verbose=False)
    threads = torch.get_num_threads()
    rate, lanes = max(peak.fma_peak(threads, 20_000_000) for _ in range(3))
    return {"macs_a_row": macs, "fma_per_s": rate, "lanes": lanes, "threads": threads,
            "gflops": 2 * lanes * rate / 1e9, "floor_ms_a_row": 1e3 * macs / (lanes * rate)}


if __name__ == "__main__":
    main()

"""The readout projection: transformers' lm_head (`linear`) against the engine's Readout.

    python -m bench.readout [--model NAME] [--rows 1 2 4 9 16]

Times the model's output projection on R random hidden rows (median of repeats, one process)
and checks both give the same logits to float tolerance. Before each call a buffer larger than
the CPU's caches is touched, as the rest of the model's weights are in a real pass, so the
weight is read from memory as it would be.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from host import store
from host.engine.readout import Readout

from .common import machine, on_compute, table, write


def median_ms(fn, repeats: int, evict: torch.Tensor) -> float:
    fn()
    ts = []
    for _ in range(repeats):
        evict.add_(1.0)
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 9, 16])
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args(argv)
    return on_compute(_run, args)  # all model work on the compute thread, as in the engine


def _run(args) -> dict:
    engine = store.open_engine(args.model, kv_pages=16)
    head = engine.model.get_output_embeddings()
    fast = Readout(head)
    rows = []
    evict = torch.zeros(64 << 20)  # 256 MB
    with torch.inference_mode():
        for r in args.rows:
            h = torch.randn(r, engine.info.hidden_size, dtype=engine.dtype, device=engine.device)
            err = (fast(h).float() - head(h).float()).abs().max().item()
            t_lin = median_ms(lambda: head(h), args.repeats, evict)
            t_fast = median_ms(lambda: fast(h), args.repeats, evict)
            rows.append({"rows": r, "linear_ms": t_lin, "readout_ms": t_fast, "speedup": t_lin / t_fast,
                         "max_abs_diff": err})
    md = (f"lm_head of {engine.info.name} ({engine.info.dtype}, {engine.info.device}), median ms of "
          f"{args.repeats}\n\n" + table(["rows", "linear ms", "Readout ms", "speedup", "max |diff|"],
                                        [[r["rows"], r["linear_ms"], r["readout_ms"], r["speedup"],
                                          f"{r['max_abs_diff']:.1e}"] for r in rows]))
    path = write("readout", {"benchmark": "readout", "model": engine.info.name, "machine": machine(), "rows": rows}, md)
    print(md)
    print(f"\nwrote {path}")
    return {"rows": rows}


if __name__ == "__main__":
    main()

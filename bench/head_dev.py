"""How well draft heads predict the target on the dev prompts, offline (no speculative run).

    python -m bench.head_dev [--model NAME] [--heads A,B] [--prompts N] [--new-tokens 128] [--steps 3]
                             [--stops 0,0.1,...]

The target (float32, stock transformers) answers each dev prompt greedily under its chat template;
one more forward over prompt and reply gives h and the target's choice at every row, as
`pie drafter train --features forward` captures them. Each head (default: the model's attached
drafters; or head folders / trained or shipped head names) is then scored with the trainer's own
validation (`host.drafter.train.evaluate`): top-1 of its first draft over every reply row, the
chained steps' top-1 given the drafts before were right, and the expected accepted drafts for
k = 1..steps, overall and per category. The dev prompts are never trained on, so this is the
out-of-distribution figure a head's RECIPE.md held-apart split cannot give. For each confidence
stop P of --stops (`--min-prob P`: a chain ends before a draft the head gives less than P), the
drafts a chain of --steps proposes per row and how many of them are accepted.

A speculative run verifies drafts only where the last round ended (after a rejection or a
bonus token), fewer easy rows than every row: its acceptance is lower than these top-1s; compare
heads with this, and speed with bench.spec.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from .common import bar_chart, chat_ids, load_prompts, machine, table, write


def _replies(model, tok, rows: list[dict], n: int, batch: int = 8) -> list[dict]:
    from host.drafter.train import _eos_ids, until_eos

    eos = _eos_ids(model, tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else (eos[0] if eos else 0)
    seqs = []
    for i in range(0, len(rows), batch):
        enc = [chat_ids(tok, r["prompt"]) for r in rows[i:i + batch]]
        L = max(map(len, enc))
        ids = torch.tensor([[pad] * (L - len(e)) + e for e in enc])
        mask = torch.tensor([[0] * (L - len(e)) + [1] * len(e) for e in enc])
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                                 pad_token_id=pad, eos_token_id=eos or None)
        for b, e in enumerate(enc):
            reply = until_eos(out[b, L:].tolist(), eos)
            seqs.append({"prompt_index": i + b, "ids": e + reply, "prompt_len": len(e)})
        print(f"replies {min(i + batch, len(rows))}/{len(rows)}", flush=True)
    return seqs


def _head_folder(rec, name: str) -> Path:
    from host import store

    if name in rec.drafters:
        return store.drafter_path(rec, name)
    folder = store.resolve_drafter(name)[1]
    if folder is None:
        raise SystemExit("`mtp` names no head folder: attach the model's MTP layers and give the attached name")
    return folder


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--heads", default=None, help="comma-separated heads (default: the model's attached drafters)")
    ap.add_argument("--prompts", type=int, default=None, help="first N dev prompts (default: all 46)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3, help="chained drafts scored")
    ap.add_argument("--stops", default="0,0.1,0.2,0.3,0.4,0.5,0.6", help="confidence stops (min_prob) to score")
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    from host import store
    from host.drafter import train as T
    from host.drafter.mtp import load_head

    rec = store.read_record(args.model or store.DEFAULT_MODEL)
    names = args.heads.split(",") if args.heads else list(rec.drafters)
    if not names:
        raise SystemExit(f"model {rec.name} has no drafter attached; give --heads")
    tok = AutoTokenizer.from_pretrained(rec.path)
    model = store.load_model(rec, "cpu", "float32", keep_blocks=False).eval()
    rows = load_prompts(args.prompts)
    seqs = _replies(model, tok, rows, args.new_tokens)
    cfg = T.TrainConfig(name="dev", progress=False, gen_batch=len(seqs) + 1)
    import dataclasses
    import tempfile

    replies, captured = seqs, {}

    def features(layers: tuple) -> list[dict]:
        """h and the choices at every row, and for an eagle3 head its layers' inputs (once per set)."""
        if layers not in captured:
            with tempfile.TemporaryDirectory() as work:
                captured[layers] = T.capture(model, replies, dataclasses.replace(cfg, layers=list(layers)), Path(work))
        return captured[layers]
    V = model.get_output_embeddings().weight.shape[0]
    cats = sorted({r["category"] for r in rows})
    results = {}
    stops = tuple(float(x) for x in args.stops.split(",") if x)
    for name in names:
        head, spec = load_head(_head_folder(rec, name), model, dtype=torch.float32)
        head.set_attention("sdpa")
        seqs = features(head.layers)
        W = head.output_weight(model.get_output_embeddings().weight)
        vmap = torch.full((V,), T.IGNORE, dtype=torch.long)
        ids = head.draft_vocab if head.draft_vocab is not None else torch.arange(V)
        vmap[ids] = torch.arange(len(ids))
        overall = T.evaluate(head, model, seqs, vmap, W, args.steps, autocast=False, stops=stops)
        by_cat = {}
        for cat in cats:
            part = [q for q, r in zip(seqs, rows) if r["category"] == cat]
            by_cat[cat] = T.evaluate(head, model, part, vmap, W, args.steps, autocast=False)
        results[name] = {"overall": overall, "by_category": by_cat,
                         "held_apart_top1": spec.recipe.get("validation", {}).get("top1")}
        print(f"{name}: dev top-1 {overall['top1']:.3f}, expected accepted "
              + ", ".join(f"k={k + 1}: {x:.2f}" for k, x in enumerate(overall["expected_accepted"])), flush=True)

    headers = ["head", "dev top-1", *[f"accepted k={k}" for k in range(1, args.steps + 1)], "held-apart top-1 (RECIPE)"]
    f3 = "{:.3f}".format
    lines = [[n, f3(r["overall"]["top1"]), *map(f3, r["overall"]["expected_accepted"]),
              "" if r["held_apart_top1"] is None else f3(r["held_apart_top1"])] for n, r in results.items()]
    md = table(headers, lines)
    md += "\n\n" + table(["category", *names], [[c, *[f3(results[n]["by_category"][c]["top1"]) for n in names]]
                                                for c in cats])
    for n, r in results.items():
        if r["overall"].get("stops"):
            md += f"\n\n{n}, a chain of {args.steps} with a confidence stop, per reply row:\n\n" + table(
                ["min_prob", "drafts", "accepted", "accepted per draft"],
                [[f"{x['min_prob']:g}", f"{x['drafts']:.3f}", f"{x['accepted']:.3f}",
                  f"{x['accepted'] / x['drafts']:.3f}" if x["drafts"] else ""] for x in r["overall"]["stops"]])
    ids_used = [r["id"] for r in rows]
    data = {"model": rec.name, "prompts": ids_used, "new_tokens": args.new_tokens, "steps": args.steps,
            "reply_tokens": sum(len(q["ids"]) - q["prompt_len"] for q in seqs), "machine": machine(),
            "heads": results,
            "median_reply_tokens": statistics.median(len(q["ids"]) - q["prompt_len"] for q in seqs)}
    write("head_dev", data, f"Dev prompts {ids_used[0]}..{ids_used[-1]} ({len(ids_used)}), "
                            f"{args.new_tokens} tokens, greedy float32 replies\n\n" + md)
    bar_chart("head_dev", cats + ["all"], {n: [results[n]["by_category"][c]["top1"] for c in cats]
                                           + [results[n]["overall"]["top1"]] for n in names},
              "first-draft top-1", title=f"{rec.name}: draft heads on the dev prompts", rotation=30)
    print(md)
    return data


if __name__ == "__main__":
    main()

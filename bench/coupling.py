"""Sampled verification of a head's drafts: coupled to the target's own draws, or by the rejection rule.

    python -m bench.coupling [--model NAME] [--per-category 1] [--prompts N] [--new-tokens 64]
                             [--temperatures 0.7,1.0] [--seeds 2]

Runs mtp-speculative-decoding sampled on dev prompts (chat template) two ways at each temperature
and seed: the default, whose head draws its drafts with the uniforms the target's own draw at that
row uses and whose verification accepts a draft while it equals that draw (op verify_sample
without q), and `--rejection 1` (Leviathan et al.'s rule with the head's q, op draft_probs). Both
have the target's distribution; the coupled one commits the same tokens whatever was drafted. It
counts, summed over prompts and seeds, the drafts, the accepted drafts and the tokens a round
commits (a round: one target pass after the prompt's), and checks that the coupled run equals
cacheback's (no head) at the same seed. Acceptance only, no timing: the two cost the same a
round up to the q rows the rejection rule keeps. Writes JSON, a table and a chart to results/.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

from .common import bar_chart, head_engine, load_prompts, machine, per_category, table, write

CONTENDERS = [("coupled", []), ("rejection", ["--rejection", "1"])]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a model with a draft head attached (default: the default model)")
    ap.add_argument("--per-category", type=int, default=1, help="the first N dev prompts of each category")
    ap.add_argument("--prompts", type=int, default=None, help="only the first N of those")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--temperatures", default="0.7,1.0")
    ap.add_argument("--seeds", type=int, default=2, help="seeds 1..N per prompt and temperature")
    args = ap.parse_args(argv)

    from host.paths import resolve_inferlet
    from host.runtime.runtime import Runtime

    engine, drafter = head_engine(args.model)
    rows = per_category(load_prompts(), args.per_category)[:args.prompts]
    temps = [float(t) for t in args.temperatures.split(",") if t]
    totals = {(t, lb): defaultdict(int) for t in temps for lb, _ in CONTENDERS}
    same_as_cacheback = {t: [] for t in temps}
    with Runtime(engine) as rt:
        def run(inferlet, extra, prompt, t, seed):
            res = rt.run(resolve_inferlet(inferlet), ["--prompt", prompt, "--chat", "--max-tokens", str(args.new_tokens),
                                                      "--temperature", str(t), "--seed", str(seed), *extra],
                         name=inferlet, prefix_caching=False)
            if not res.ok:
                raise SystemExit(f"{inferlet} failed: {res.error}")
            return res

        for r in rows:
            for t in temps:
                for seed in range(1, args.seeds + 1):
                    for label, extra in CONTENDERS:
                        res = run("mtp-speculative-decoding", extra, r["prompt"], t, seed)
                        s = totals[(t, label)]
                        s["drafted"] += res.stats["drafted_tokens"]
                        s["accepted"] += res.stats["accepted_tokens"]
                        s["tokens"] += len(res.token_ids)  # MTP's prompt pass commits none: its rounds do
                        s["rounds"] += res.stats["passes"] - 1
                        if label == "coupled":
                            plain = run("cacheback-speculative-decoding", ["--draft-len", "0"], r["prompt"], t, seed)
                            same_as_cacheback[t].append(plain.token_ids == res.token_ids)
            print(f"prompt {r['id']} ({r['category']}) done", flush=True)

    summary = {}
    for (t, label), s in totals.items():
        summary[f"{label} T={t}"] = {"temperature": t, "rule": label, **s,
                                     "accepted_per_draft": s["accepted"] / max(s["drafted"], 1),
                                     "tokens_per_round": s["tokens"] / max(s["rounds"], 1)}
    result = {"benchmark": "coupling", "model": engine.info.name, "drafter": drafter, "prompts": [r["id"] for r in rows],
              "new_tokens": args.new_tokens, "seeds": args.seeds, "machine": machine(), "summary": summary,
              "coupled_equals_plain": {str(t): all(v) for t, v in same_as_cacheback.items()}}
    md = (f"mtp-speculative-decoding sampled (top-p 1), {engine.info.name} with {drafter}; dev prompts "
          f"{result['prompts']}, chat template, {args.new_tokens} new tokens, seeds 1..{args.seeds}: drafts "
          "coupled to the target's own draws and verified against them, against Leviathan's rejection rule "
          "with the head's q (`--rejection 1`).\n\n"
          + table(["rule", "T", "drafts", "accepted", "accepted a draft", "tokens a round", "same as plain sampling"],
                  [[v["rule"], v["temperature"], v["drafted"], v["accepted"], v["accepted_per_draft"],
                    v["tokens_per_round"], str(all(same_as_cacheback[v["temperature"]])) if v["rule"] == "coupled" else ""]
                   for v in summary.values()]))
    write("coupling", result, md)
    bar_chart("coupling", [f"T={t}" for t in temps],
              {lb: [summary[f"{lb} T={t}"]["accepted_per_draft"] for t in temps] for lb, _ in CONTENDERS},
              "accepted drafts per draft", title=f"{engine.info.name} + {drafter}, sampled")
    print(md)


if __name__ == "__main__":
    main()

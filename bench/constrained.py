"""Grammar-constrained decoding on the dev JSON schemas, side by side in one process run.

    python -m bench.constrained [--schemas N] [--new-tokens 192] [--dtype auto] [--repeats 1] [--draft-len 8]

Contenders, on the same model, dtype, schemas and prompts (each schema's prompt in the chat
template; the grammar is llguidance's for the schema, with the product's JSON style):
  hf-grammar       HF `generate`, greedy, with llguidance's token masks applied by a logits
                   processor (how a transformers user constrains output);
  constrained-plain      the constrained-speculative-decoding inferlet with --draft-len 0;
  constrained-spec       the same inferlet with drafts (forced tokens, then prompt lookup).
Per schema: tokens/s, whether the output finished and validates (jsonschema), committed tokens
per target pass, and how many output tokens the grammar forced. Runs are interleaved, the
fastest of --repeats counts. Writes JSON, a markdown table and a chart to results/.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import jsonschema
import torch

from host import store

from .common import bar_chart, chat_ids, geomean, load_hf, machine, on_compute, table, write

SCHEMAS = Path(__file__).resolve().parents[1] / "data" / "jsonschema-dev.jsonl"
OURS = ("constrained-plain", "constrained-spec")
CONTENDERS = ("hf-grammar", *OURS)


def load_schemas(limit: int | None = None) -> list[dict]:
    rows = [json.loads(line) for line in SCHEMAS.read_text().splitlines() if line.strip()]
    return rows[:limit] if limit else rows


class GrammarProcessor:
    """A transformers logits processor: the matcher consumes the last chosen token, and every
    token it forbids gets -inf (llguidance's bitmask, applied in place)."""

    def __init__(self, matcher, prompt_len: int):
        self.m, self.prompt_len = matcher, prompt_len

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] > self.prompt_len:
            self.m.accept([int(input_ids[0, -1])])
        words = torch.from_numpy(self.m.bitmask().view("int32"))
        bits = (words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        allowed = bits.flatten()[:scores.shape[-1]].bool()
        return scores.masked_fill(~allowed, float("-inf"))


@torch.inference_mode()
def _hf_grammar(model, tok, grammar, ids, n):
    from transformers import LogitsProcessorList

    x = torch.tensor([ids], device=model.device)
    t0 = time.perf_counter()
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                         pad_token_id=tok.eos_token_id,
                         logits_processor=LogitsProcessorList([GrammarProcessor(grammar.matcher(), len(ids))]))
    return out[0, len(ids):].tolist(), time.perf_counter() - t0


def forced_count(grammar, token_ids: list[int]) -> int:
    """Output tokens the grammar forced (it allowed that one continuation only)."""
    m, n = grammar.matcher(), 0
    for t in token_ids:
        f = m.forced()
        n += bool(f) and f[0] == t
        if m.accept([t]) != 1:
            break
    return n


def outcome(row, text: str, token_ids: list[int], eos: set[int]) -> dict:
    finished = bool(token_ids) and token_ids[-1] in eos
    valid = False
    if finished:
        try:
            jsonschema.validate(json.loads(text), row["schema"])
            valid = True
        except (ValueError, jsonschema.ValidationError):
            pass
    return {"finished": finished, "valid": valid}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--schemas", type=int, default=None, help="first N dev schemas (default: all 35)")
    ap.add_argument("--new-tokens", type=int, default=192)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--draft-len", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=1, help="runs per contender and schema; the fastest counts")
    args = ap.parse_args(argv)

    from host.paths import resolve_inferlet
    from host.runtime.grammars import grammars_for
    from host.runtime.runtime import Runtime

    engine = store.open_engine(args.model, device="auto", dtype=args.dtype, kv_pages=1024)
    hf, tok = load_hf(engine), engine.tokenizer
    grammars = grammars_for(engine)
    eos = set(engine.info.eos_ids)
    wasm = resolve_inferlet("constrained-speculative-decoding")
    rows, n = load_schemas(args.schemas), args.new_tokens
    per_schema = []
    with Runtime(engine) as rt:
        warm = ["--prompt", "Hi", "--chat", "--max-tokens", "4", "--regex", "[a-z]+"]
        rt.run(wasm, warm)
        for i, row in enumerate(rows):
            schema = json.dumps(row["schema"])
            grammar = grammars.compile("json-schema", schema)
            ids = chat_ids(tok, row["prompt"])
            rec = {"id": row["id"], "set": row["id"].split("/")[0], "prompt_tokens": len(ids)}
            for rep in range(max(args.repeats, 1)):
                order = CONTENDERS if rep % 2 == 0 else tuple(reversed(CONTENDERS))
                for c in order:
                    gc.collect()
                    if c == "hf-grammar":
                        toks, wall = on_compute(_hf_grammar, hf, tok, grammar, ids, n)
                        got = {"token_ids": toks, "wall_s": wall, "passes": len(toks), "accepted": 0, "drafted": 0,
                               "text": tok.decode(toks, skip_special_tokens=True)}
                    else:
                        k = "0" if c == "constrained-plain" else str(args.draft_len)
                        res = rt.run(wasm, ["--prompt", row["prompt"], "--chat", "--max-tokens", str(n),
                                            "--json-schema", schema, "--draft-len", k], prefix_caching=False)
                        if not res.ok:
                            raise SystemExit(f"{c} failed on {row['id']}: {res.error}")
                        s = res.stats
                        got = {"token_ids": res.token_ids, "wall_s": s["wall_s"], "passes": s["passes"] - 1,
                               "accepted": s["accepted_tokens"], "drafted": s["drafted_tokens"], "text": res.text}
                    if c not in rec or got["wall_s"] < rec[c]["wall_s"]:
                        rec[c] = got
            for c in CONTENDERS:
                r = rec[c]
                r.update(outcome(row, r.pop("text"), r["token_ids"], eos))
                r["tokens"] = len(r["token_ids"])
                r["tps"] = r["tokens"] / r["wall_s"]
                r["per_pass"] = r["tokens"] / max(r["passes"], 1)  # committed tokens per decode pass
            spec = rec["constrained-spec"]
            spec["forced"] = forced_count(grammar, spec["token_ids"])
            ref = rec["constrained-plain"]["token_ids"]
            for c in CONTENDERS:
                rec[c]["same_as_plain"] = rec[c]["token_ids"] == ref
            for c in CONTENDERS:
                rec[c].pop("token_ids")
            per_schema.append(rec)
            print(f"[{i + 1}/{len(rows)}] {row['id']}: " + "  ".join(
                f"{c}={rec[c]['tps']:.1f} tok/s{'' if rec[c]['valid'] or not rec[c]['finished'] else ' INVALID'}"
                for c in CONTENDERS) + f"  ({spec['tokens']} tokens, {spec['forced']} forced)", flush=True)

    return report(per_schema, engine, n, args)


def report(per_schema: list[dict], engine, n: int, args) -> dict:
    sets = sorted({r["set"] for r in per_schema})

    def summarize(rs):
        out = {}
        for c in CONTENDERS:
            fin = [r for r in rs if r[c]["finished"]]
            out[c] = {"tps_median": statistics.median(r[c]["tps"] for r in rs),
                      "finished": len(fin), "valid_of_finished": sum(r[c]["valid"] for r in fin) / max(len(fin), 1),
                      "per_pass": statistics.mean(r[c]["per_pass"] for r in rs)}
        for c in OURS:
            out[c]["speedup_vs_hf_grammar"] = geomean([r[c]["tps"] / r["hf-grammar"]["tps"] for r in rs])
        out["constrained-spec"]["speedup_vs_plain"] = geomean(
            [r["constrained-spec"]["tps"] / r["constrained-plain"]["tps"] for r in rs])
        spec = [r["constrained-spec"] for r in rs]
        passes = sum(s["passes"] for s in spec)
        out["constrained-spec"]["forced_per_pass"] = sum(s["forced"] for s in spec) / max(passes, 1)
        out["constrained-spec"]["drafted_accepted_per_pass"] = sum(max(s["accepted"] - s["forced"], 0) for s in spec) / max(passes, 1)
        return out

    summary = {"ALL": summarize(per_schema), **{s: summarize([r for r in per_schema if r["set"] == s]) for s in sets}}
    same = {c: all(r[c]["same_as_plain"] for r in per_schema) for c in CONTENDERS}
    result = {"benchmark": "constrained", "model": engine.info.name, "dtype": engine.info.dtype,
              "device": engine.info.device, "new_tokens": n, "draft_len": args.draft_len, "repeats": args.repeats,
              "schemas": [r["id"] for r in per_schema], "machine": machine(), "identical_to_constrained_plain": same,
              "summary": summary, "per_schema": per_schema}
    headers = ["set", "schemas"] + [f"{c} tok/s" for c in CONTENDERS] + [
        "spec / hf-grammar", "spec / plain", "plain / hf-grammar", "valid (finished)", "spec tok/pass",
        "forced/pass", "drafted acc/pass"]
    trows = []
    for s in [*sets, "ALL"]:
        sm = summary[s]
        k = sum(1 for r in per_schema if s == "ALL" or r["set"] == s)
        valid = "; ".join(f"{c} {sm[c]['valid_of_finished']:.0%} ({sm[c]['finished']})" for c in CONTENDERS)
        trows.append([s, k] + [sm[c]["tps_median"] for c in CONTENDERS] + [
            sm["constrained-spec"]["speedup_vs_hf_grammar"], sm["constrained-spec"]["speedup_vs_plain"],
            sm["constrained-plain"]["speedup_vs_hf_grammar"], valid, sm["constrained-spec"]["per_pass"],
            sm["constrained-spec"]["forced_per_pass"], sm["constrained-spec"]["drafted_accepted_per_pass"]])
    md = (f"Constrained decoding, {engine.info.name} {engine.info.dtype} on {engine.info.device}; {len(per_schema)} "
          f"dev schemas (JSONSchemaBench, data/jsonschema-dev.jsonl); chat template; up to {n} new tokens; "
          f"greedy; draft length {args.draft_len}; fastest of {args.repeats} interleaved run(s).\n"
          f"tok/s: median; ratios: geometric means of per-schema tok/s; valid: finished outputs that validate "
          f"(jsonschema), with the number finished; tok/pass: committed tokens per decode pass; forced/pass: output "
          f"tokens the grammar forced, per pass; drafted acc/pass: the other accepted drafts, per pass. "
          f"Identical tokens to constrained plain decoding: {same}\n\n" + table(headers, trows))
    path = write("constrained", result, md)
    chart(per_schema, sets)
    print(md)
    print(f"\nwrote {path} and results/constrained.png")
    return result


def chart(per_schema, sets) -> None:
    groups = [*sets, "ALL"]
    bar_chart("constrained", groups,
              {c: [statistics.median(r[c]["tps"] for r in per_schema if g == "ALL" or r["set"] == g) for g in groups]
               for c in CONTENDERS},
              "tokens/s (median)", title="JSON-schema-constrained decoding", width_in=9, rotation=20)


if __name__ == "__main__":
    main()

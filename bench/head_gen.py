"""How fast `pie drafter train` makes its data: transformers' generate against the engine's batched
passes (`--generator hf` against `--generator engine`), on the same batch of training prompts.

    python -m bench.head_gen [--model smollm2-135m] [--batch 128] [--max-new-tokens 192] [--rounds 2]
                             [--layers 2,15,27]

Each round runs host.drafter.train.generate once per generator on one shard of `--batch` prompts
of the trainer's own prompt set (never the benchmark prompts), greedy, the eagle3 layers'
features captured as training captures them, in a fresh work folder; the generators alternate.
Reports reply tokens/s per generator (the faster round), and how many replies agree token for
token (the hf one runs in bfloat16, the engine in float32 over the stored weights: they may part
at near-ties). Writes results/head_gen.{json,md}.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

import torch

from .common import machine, table, write


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--layers", default=None, help="eagle3 feature layers (default: EAGLE-3's three)")
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from host import weights
    from host.cli.drafter import _engine, _resolve_model
    from host.drafter.mtp import default_layers
    from host.drafter.prompts import training_prompts, vocabulary_words
    from host.drafter.train import TrainConfig, _reply_tokens, generate

    folder = _resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(folder)
    target = weights.load(folder, torch.float32, torch.device("cpu"), keep=False).eval()
    layers = [int(x) for x in args.layers.split(",")] if args.layers else default_layers(target.config.num_hidden_layers)
    prompts = training_prompts(0, vocabulary_words(tok))[:args.batch]
    base = TrainConfig(name="bench", tokens=1, max_new_tokens=args.max_new_tokens, gen_batch=args.batch,
                       sample_every=0, layers=layers, progress=False)
    best: dict[str, float] = {}
    replies: dict[str, list] = {}
    tokens: dict[str, int] = {}
    for r in range(args.rounds):
        for gen in ("hf", "engine"):
            cfg = dataclasses.replace(base, generator=gen)
            with tempfile.TemporaryDirectory() as work:
                t0 = time.perf_counter()
                seqs = generate(target, tok, prompts, cfg, Path(work),
                                engine_factory=lambda pages: _engine(folder, tok, pages))
                secs = time.perf_counter() - t0
            tokens[gen] = _reply_tokens(seqs)
            rate = tokens[gen] / secs
            best[gen] = max(best.get(gen, 0.0), rate)
            replies[gen] = [q["ids"][q["prompt_len"]:].tolist() for q in seqs]
            print(f"round {r + 1}, {gen}: {tokens[gen]} reply tokens in {secs:.1f} s, {rate:.1f} tokens/s", flush=True)
    same = sum(a == b for a, b in zip(replies["hf"], replies["engine"]))
    result = {"benchmark": "head_gen", "args": vars(args), "machine": machine(), "tokens_per_s": best,
              "reply_tokens": tokens, "identical_replies": same, "replies": len(prompts),
              "engine_over_hf": best["engine"] / best["hf"]}
    md = (f"Data generation for `pie drafter train` ({args.model}): one shard of {args.batch} training prompts, "
          f"up to {args.max_new_tokens} new tokens, greedy, eagle3 features of layers {layers} captured; "
          f"{args.rounds} rounds, generators alternating, the faster round kept. Machine: {result['machine']}.\n\n"
          + table(["generator", "reply tokens", "tokens/s", "vs hf"],
                  [[g, tokens[g], best[g], best[g] / best["hf"]] for g in ("hf", "engine")])
          + f"\n\nReplies identical token for token: {same} of {len(prompts)} (hf in bfloat16, the engine in "
          "float32 over the stored weights).")
    write("head_gen", result, md)
    print(md)
    return result


if __name__ == "__main__":
    main()

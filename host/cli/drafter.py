"""`pie drafter train MODEL --name NAME`: self-distil an MTP draft head for an imported model.

host/cli/__init__.py registers it with `add_parser(subparsers)` (the `drafter` command's subparsers).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path


def _add_train_args(p: argparse.ArgumentParser) -> None:
    from ..drafter.train import TrainConfig

    d = TrainConfig(name="")
    p.add_argument("model", help="an imported model's name (see `pie model list`) or a model folder")
    p.add_argument("--name", required=True, help="the head's name (saved to $PIE_HOME/drafters/NAME)")
    p.add_argument("--out", type=Path, help="where to save the head (default $PIE_HOME/drafters/NAME)")
    p.add_argument("--work-dir", type=Path,
                   help="cache of replies, features and checkpoints (default: NAME.work next to --out)")
    p.add_argument("--tokens", type=int, default=d.tokens, help=f"reply tokens to generate (default {d.tokens})")
    p.add_argument("--context-share", type=float, default=d.context_share,
                   help=f"share of --tokens generated in the second round, tasks over the first round's replies "
                        f"(summarise, translate, extract...; 0: none; default {d.context_share})")
    p.add_argument("--no-word-prompts", action="store_true",
                   help="only the fixed prompt set: no prompts about words of the model's vocabulary")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens,
                   help=f"longest reply per prompt (default {d.max_new_tokens})")
    p.add_argument("--epochs", type=int, default=d.epochs, help=f"passes over the training replies (default {d.epochs})")
    p.add_argument("--lr", type=float, default=d.lr, help=f"peak AdamW learning rate (default {d.lr})")
    p.add_argument("--draft-vocab", type=int, default=d.draft_vocab,
                   help=f"draft vocabulary size; 0 picks the smallest covering {d.coverage * 100:.0f}%% of the labels (default 0)")
    p.add_argument("--seed", type=int, default=d.seed, help=f"prompt order, sampling and batch order (default {d.seed})")
    p.add_argument("--batch", type=int, default=d.batch, help=f"sequences per optimizer step (default {d.batch})")
    p.add_argument("--gen-batch", type=int, default=d.gen_batch, help=f"prompts per generation batch (default {d.gen_batch})")
    p.add_argument("--gen-dtype", default=d.gen_dtype, choices=["bfloat16", "float32", "auto"],
                   help="dtype the replies are generated in (features always use the model's own; default bfloat16)")
    p.add_argument("--generator", default=d.generator, choices=["hf", "engine"],
                   help="who writes the replies: transformers' generate in --gen-dtype (hf), or the engine's batched "
                        "passes on the model as served, its features read out of the same passes (engine; "
                        f"default {d.generator})")
    p.add_argument("--features", default=d.features, choices=["generate", "forward"],
                   help="capture h and the target's argmax while generating (default, fast) or by one more "
                        "forward of the model in its own dtype (exact, slower)")
    p.add_argument("--unroll", type=int, default=d.unroll, help=f"chained draft steps trained (default {d.unroll})")
    p.add_argument("--kind", default="mtp", choices=["mtp", "eagle3"],
                   help="mtp: the head reads the last layer's output; eagle3: the inputs of --layers, fused")
    p.add_argument("--layers", default=None,
                   help="eagle3: comma-separated layer indices (default EAGLE-3's low, middle, high: 2, L/2, L-3)")
    p.add_argument("--soft", type=float, default=d.soft,
                   help=f"weight of the soft target (the model's own distribution over the draft vocabulary) "
                        f"against its argmax label, 0..1 (default {d.soft})")
    p.add_argument("--init", default=d.init, choices=["target", "block", "random"],
                   help="the head's initial weights: random (default, measured best), block (block and final norm copied from the target's last layer), target (also eh_proj = [0 | I])")
    p.add_argument("--no-autocast", action="store_true", help="train in float32 (default: bfloat16 autocast)")
    p.add_argument("--resume", action="store_true", help="continue from the work folder's checkpoint")
    p.add_argument("--budget-minutes", type=float, default=None, metavar="M",
                   help="stop after M minutes of this run, at the next generation shard or training step, "
                        "checkpointed (every 50 steps and 10 minutes anyway); --resume goes on (default: no budget)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def _resolve_model(model: str) -> Path:
    from .. import paths, store
    from ..errors import InvalidArgument

    p = Path(model).expanduser()
    if p.is_dir() and (p / "config.json").exists():
        return p
    try:
        rec = store.read_record(model)
    except Exception as e:  # ModelNotFound and friends: say what to do
        raise InvalidArgument(f"no model {model!r}: import it first (`pie model import {model}`) or give a folder") from e
    folder = Path(rec.path) if rec.path else paths.models_dir() / rec.name
    return folder if (folder / "config.json").exists() else paths.models_dir() / rec.name


def _engine(folder, tok, kv_pages: int):
    """The engine that generates with --generator engine: the model as served (a GGUF import's
    blocks kept), float32, a pool of kv_pages; built on the compute thread, as every engine."""
    import torch

    from .. import weights
    from ..engine import Engine
    from ..engine.compute import compute

    def build():
        m = weights.load(folder, torch.float32, torch.device("cpu"), keep=True).eval()
        return Engine(m, tok, name=folder.name, kv_pages=kv_pages, prefix_caching=False, suffix_tokens=0)

    return compute().call(build)


def run(args) -> int:
    import torch
    from transformers import AutoTokenizer

    from ..drafter.train import TrainConfig, train

    from .. import weights

    folder = _resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(folder)
    # training runs transformers' layers: a GGUF import's blocks widened (exactly)
    model = weights.load(folder, torch.float32, torch.device("cpu"), keep=False).eval()
    layers = []
    if args.kind == "eagle3":
        from ..drafter.mtp import default_layers
        from ..errors import InvalidArgument

        try:
            layers = ([int(x) for x in args.layers.split(",")] if args.layers
                      else default_layers(model.config.num_hidden_layers))
        except ValueError:
            raise InvalidArgument(f"--layers takes comma-separated layer indices, not {args.layers!r}") from None
    elif args.layers:
        from ..errors import InvalidArgument

        raise InvalidArgument("--layers is for --kind eagle3")
    cfg = TrainConfig(name=args.name, out=args.out, work_dir=args.work_dir, tokens=args.tokens,
                      context_share=args.context_share, word_prompts=not args.no_word_prompts,
                      max_new_tokens=args.max_new_tokens, epochs=args.epochs, lr=args.lr, draft_vocab=args.draft_vocab,
                      seed=args.seed, batch=args.batch, gen_batch=args.gen_batch, gen_dtype=args.gen_dtype,
                      generator=args.generator,
                      unroll=args.unroll, soft=args.soft, features=args.features, init=args.init, autocast=not args.no_autocast, resume=args.resume,
                      layers=layers, budget_s=None if args.budget_minutes is None else args.budget_minutes * 60,
                      progress=not args.quiet,
                      command=getattr(args, "command_line", None) or "pie " + shlex.join(sys.argv[1:]))
    res = train(model, tok, cfg, engine_factory=lambda pages: _engine(folder, tok, pages))
    if res["interrupted"]:
        return 0  # stopped at --budget-minutes, checkpointed: train() said how to go on
    v = res["validation"]
    print(f"saved {res['out']}: validation top-1 {v['top1']:.3f}, step-2 top-1 {v['top1_step2']:.3f}, "
          f"expected accepted drafts (k=1..4) {', '.join(f'{x:.2f}' for x in v['expected_accepted'])}")
    return 0


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `train` under the `drafter` command's subparsers; its handler is `args.func`."""
    p = subparsers.add_parser("train", help="self-distil an MTP draft head for a model (CPU, minutes)",
                              description=__doc__.splitlines()[0])
    _add_train_args(p)
    p.set_defaults(func=run)
    return p


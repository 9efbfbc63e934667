"""`pie run NAME_OR_WASM [--model MODEL] [--json] [LIMIT FLAGS] [-- ARGS...]`: run one inferlet in-process."""

from __future__ import annotations

import argparse
import json
import os
import sys

from ..paths import resolve_inferlet
from ..runtime.limits import add_flags, from_args


def _add_options(p) -> None:
    p.add_argument("--model", help="store model name (default: smollm2-135m)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--prefix-caching", default="auto", choices=["auto", "on", "off"],
                   help="reuse KV rows of earlier prompts with the same start (docs/prefix-caching.md); auto: where the engine's "
                        "rows are exact whatever their pass (CPU float32 with the kernels)")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object with text, token_ids and stats")
    p.add_argument("--logprobs", type=int, metavar="N",
                   help="with --json: each generated token's logprob and its N most likely alternatives (0..20)")
    add_flags(p)  # the limits' flags: host/runtime/limits.py
    p.add_argument("--server", metavar="URL", help="run on a `pie serve` daemon at URL instead of in-process "
                   "(a .wasm path is uploaded; a name is the server's built-in)")
    p.add_argument("--api-key", default=os.environ.get("PIE_API_KEY"),
                   help="the daemon's bearer key (default: $PIE_API_KEY)")


def add_run_parser(subparsers) -> None:
    p = subparsers.add_parser("run", help="run one inferlet in-process",
                              description="Run an inferlet. Arguments after `--` go to the inferlet, e.g. "
                                          "pie run text-completion --json -- --prompt 'Hi' --chat --max-tokens 32")
    p.add_argument("inferlet", help="a built inferlet's name, or a path to a .wasm component")
    _add_options(p)
    # argparse cannot hand `-- ARGS` to a subcommand intact, so take the rest raw and split it in cmd_run
    p.add_argument("rest", nargs=argparse.REMAINDER, help="[pie run options] -- the inferlet's arguments")
    p.set_defaults(func=cmd_run)


def _split_rest(args) -> list[str]:
    """The inferlet's arguments: everything after `--`, plus anything before it that is not pie's.

    argparse swallows a `--` that comes right after the inferlet name when options precede
    the name, so arguments that are not `pie run` options are passed on rather than refused.
    """
    rest = list(args.rest)
    ours, theirs = (rest[:rest.index("--")], rest[rest.index("--") + 1:]) if "--" in rest else (rest, [])
    if not ours:
        return theirs
    extra = argparse.ArgumentParser(prog="pie run", add_help=False, allow_abbrev=False)
    _add_options(extra)
    _, unknown = extra.parse_known_args(ours, namespace=args)
    return unknown + theirs


def _asked_limits(args) -> dict:
    """The limit flags given other than their defaults, keyed as the inferlet API names them."""
    defaults = argparse.ArgumentParser(add_help=False)
    add_flags(defaults)
    base = vars(defaults.parse_args([]))
    return {k: getattr(args, k) for k, v in base.items() if getattr(args, k) != v}


def cmd_run(args) -> int:
    inferlet_args = _split_rest(args)
    limits = from_args(args)  # checked before the model loads
    if args.logprobs is not None and not args.json:
        print("pie: error: --logprobs needs --json (they are printed in its `logprobs`)", file=sys.stderr)
        return 2
    if args.logprobs is not None:
        from ..engine.logprobs import MAX_TOP

        if not 0 <= args.logprobs <= MAX_TOP:
            print(f"pie: error: --logprobs {args.logprobs}: the alternatives are 0..{MAX_TOP}", file=sys.stderr)
            return 2
    if args.server:  # the server resolves names: it may have built-ins this machine lacks
        if args.logprobs is not None:
            print("pie: error: --logprobs is not offered with --server (use the OpenAI endpoints' logprobs)",
                  file=sys.stderr)
            return 2
        from ..daemon.client import run_remote

        return run_remote(args.server, args.api_key, args.inferlet, inferlet_args, _asked_limits(args), args.json)

    from ..runtime.runtime import Runtime
    from ..store import open_engine

    wasm = resolve_inferlet(args.inferlet)
    engine = open_engine(args.model, device=args.device, dtype=args.dtype,
                         prefix_caching={"auto": None, "on": True, "off": False}[args.prefix_caching])
    on_text = None if args.json else (lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    with Runtime(engine, limits=limits) as rt:
        result = rt.run(wasm, inferlet_args, name=wasm.stem, on_text=on_text, logprobs=args.logprobs)
    if args.json:
        print(json.dumps(result.to_json(), ensure_ascii=False))
    elif result.text and not result.text.endswith("\n"):
        print()
    if not result.ok:
        if result.log.strip():
            sys.stderr.write(result.log if result.log.endswith("\n") else result.log + "\n")
        print(f"pie: error: {result.inferlet}: {result.error}", file=sys.stderr)
        return 1
    return 0

"""The `pie` command line."""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from ..errors import PieError
from ..store import ACTIVATIONS


def _cmd_import(args) -> int:
    from .. import store

    rec, created = store.import_model(args.source, name=args.name, dtype=args.dtype, drafter=args.drafter,
                                      progress=sys.stderr.isatty() or args.progress, activations=args.activations)
    state = "imported" if created else "already imported"
    drafters = f", drafters {','.join(rec.drafters)}" if rec.drafters else ""
    print(f"{state}: {rec.name} ({rec.architecture}, {rec.parameters / 1e6:.1f}M parameters, {rec.format_summary()}{drafters}) "
          f"at {rec.path}")
    return 0


def _cmd_list(args) -> int:
    from dataclasses import asdict

    from .. import store

    recs = store.list_models()
    if args.json:
        print(json.dumps([asdict(r) for r in recs], indent=2))
        return 0
    if not recs:
        print("no models imported; run `pie model import smollm2-135m`")
        return 0
    rows = [("NAME", "ARCHITECTURE", "PARAMS", "FORMATS", "SIZE", "DRAFTERS", "PATH")]
    rows += [(r.name, r.architecture, f"{r.parameters / 1e6:.1f}M", r.format_summary(),
              f"{r.bytes / 1e6:.0f} MB" if r.bytes else "-", ",".join(r.drafters) or "-", r.path) for r in recs]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    return 0


def _cmd_remove(args) -> int:
    from .. import store

    store.remove_model(args.name, drafter=args.drafter)
    print(f"removed drafter {args.drafter} from {args.name}" if args.drafter else f"removed {args.name}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pie", description="Programmable LLM inference host")
    sub = parser.add_subparsers(dest="command", required=True)

    model = sub.add_parser("model", help="manage the model store ($PIE_HOME, default ~/.cache/pie)")
    msub = model.add_subparsers(dest="model_command", required=True)
    imp = msub.add_parser("import", help="convert a model into the store")
    imp.add_argument("source", help="alias (smollm2-135m), Hugging Face model folder, or .gguf file")
    imp.add_argument("--name", help="store name (default: the alias or the folder/file name)")
    imp.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                     help="auto: a GGUF file keeps its quantized blocks (read as stored), a model folder its dtype; "
                          "float32 or bfloat16: widened at import")
    imp.add_argument("--activations", default="exact", choices=ACTIVATIONS,
                     help="exact (the default): products of float32 activations and the weights widened exactly; "
                          "q8: a GGUF's Q4_0/Q4_1/Q8_0/K-quant blocks times activations quantized to 8 bits a row, as "
                          "llama.cpp computes (faster, not the dequantized model's output); default name NAME-q8")
    imp.add_argument("--drafter", action="append",
                     help="attach a draft head: mtp (the MTP layers inside SOURCE), a head folder, or a trained "
                          "head's name ($PIE_HOME/drafters); may be given more than once; on a model already "
                          "imported from SOURCE it is attached in place")
    imp.add_argument("--progress", action="store_true", help="show the progress bar even when not on a terminal")
    imp.set_defaults(func=_cmd_import)
    ls = msub.add_parser("list", help="list imported models")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=_cmd_list)
    rm = msub.add_parser("remove", help="delete a model from the store (its drafters with it)")
    rm.add_argument("name")
    rm.add_argument("--drafter", help="detach only this drafter from the model")
    rm.set_defaults(func=_cmd_remove)

    drafter = sub.add_parser("drafter", help="train draft heads for imported models")
    from .drafter import add_parser as add_train_parser

    add_train_parser(drafter.add_subparsers(dest="drafter_command", required=True))

    try:
        from .run import add_run_parser
    except ModuleNotFoundError as e:  # model management works without the runtime
        if e.name not in ("host.runtime", "host.cli.run"):
            raise
    else:
        add_run_parser(sub)
        from .serve import add_serve_parser  # the daemon runs inferlets: it needs the runtime

        add_serve_parser(sub)
        from .conformance import add_conformance_parser  # the suite runs its probe on the runtime

        add_conformance_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.command_line = "pie " + shlex.join(argv)  # a trained head records the command that made it
    try:
        return args.func(args)
    except PieError as e:
        print(f"pie: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

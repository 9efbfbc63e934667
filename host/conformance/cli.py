"""`pie conformance [--only PATTERN] [--json FILE] [--expect-fail FILE]`: the WIT conformance
suite against the in-process host."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def add_conformance_parser(subparsers) -> None:
    p = subparsers.add_parser("conformance", help="run the WIT conformance suite against the in-process host",
                              description="Run conformance/cases/ against the in-process host: one line per case "
                                          "(PASS, FAIL, SKIP), then `N passed, N failed, N skipped`. Exits 1 on a "
                                          "failure not listed in --expect-fail.")
    p.add_argument("--only", metavar="PATTERN", help="cases whose name matches this glob (or contains it)")
    p.add_argument("--json", metavar="FILE", type=Path, help="also write the results as JSON")
    p.add_argument("--expect-fail", metavar="FILE", type=Path, help="this host's known failures, one case name a line")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (cases needing cuda run only there)")
    p.add_argument("--cases", type=Path, help="the cases' folder (default: conformance/cases)")
    p.set_defaults(func=cmd_conformance)


def main(args, out=sys.stdout, cache_dir: Path | None = None) -> int:
    from . import case as fmt
    from .adapter import InProcessAdapter
    from .models import suite_model
    from .probe import probe_wasm
    from .runner import read_expect_fail, run_suite, select

    root = args.cases or fmt.CASES
    try:
        cases = fmt.load_all(root)
        expect_fail = read_expect_fail(args.expect_fail, {c.name for c in cases}) if args.expect_fail else set()
    except fmt.CaseError as e:
        print(f"pie conformance: {e}", file=sys.stderr)
        return 2
    chosen = select(cases, args.only)
    if not chosen:
        print(f"pie conformance: no case matches {args.only!r}", file=sys.stderr)
        return 2

    def open_host(model: str):
        m = suite_model(model)
        return InProcessAdapter(m, cache_dir=cache_dir, device=args.device), m.reference

    report = run_suite(chosen, open_host, probe_wasm(), expect_fail, out=out)
    if args.json:
        args.json.write_text(json.dumps(report.to_json(InProcessAdapter.name), indent=2) + "\n")
    return 1 if report.unexpected_failures else 0


def cmd_conformance(args) -> int:
    return main(args)

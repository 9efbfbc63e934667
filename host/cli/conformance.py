"""`pie conformance [--server URL] [--only PATTERN] [--json FILE] [--expect-fail FILE]`: the WIT
conformance suite against the in-process host or a running `pie serve` daemon."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def add_conformance_parser(subparsers) -> None:
    p = subparsers.add_parser("conformance", help="run the WIT conformance suite against a host",
                              description="Run conformance/cases/ against the in-process host, or with --server "
                                          "against a running `pie serve`: one line per case (PASS, FAIL, SKIP), "
                                          "then `N passed, N failed, N skipped`. Exits 1 on a failure not listed "
                                          "in --expect-fail, 2 when the suite cannot run.")
    p.add_argument("--server", metavar="URL", help="a `pie serve` daemon (its inferlet API) instead of the in-process "
                                                   "host; cases on a model it does not serve SKIP")
    p.add_argument("--api-key", help="the daemon's API key (default: $PIE_API_KEY)")
    p.add_argument("--only", metavar="PATTERN", help="cases whose name matches this glob (or contains it)")
    p.add_argument("--json", metavar="FILE", type=Path, help="also write the results as JSON")
    p.add_argument("--expect-fail", metavar="FILE", type=Path, help="this host's known failures, one case name a line")
    p.add_argument("--device", default="cpu", help="in process: cpu or cuda[:N] (cases needing cuda run only there)")
    p.add_argument("--cases", type=Path, help="the cases' folder (default: conformance/cases)")
    p.set_defaults(func=cmd_conformance)


def main(args, out=sys.stdout, cache_dir: Path | None = None) -> int:
    from ..errors import PieError
    from ..conformance import case as fmt
    from ..conformance.adapter import InProcessAdapter
    from ..conformance.daemon import DaemonAdapter
    from ..conformance.models import suite_model
    from ..conformance.probe import probe_wasm
    from ..conformance.runner import read_expect_fail, run_suite, select

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
        m = suite_model(model)  # over a daemon too: the reference is the suite's own, never the host's
        if args.server:
            return DaemonAdapter(args.server, args.api_key or os.environ.get("PIE_API_KEY")), m.reference
        return InProcessAdapter(m, cache_dir=cache_dir, device=args.device), m.reference

    try:
        report = run_suite(chosen, open_host, probe_wasm(), expect_fail, out=out)
    except PieError as e:  # the host could not be reached or refused the probe: no case could run
        print(f"pie conformance: {e}", file=sys.stderr)
        return 2
    if args.json:
        host = f"{DaemonAdapter.name} {args.server}" if args.server else InProcessAdapter.name
        args.json.write_text(json.dumps(report.to_json(host), indent=2) + "\n")
    return 1 if report.unexpected_failures else 0


def cmd_conformance(args) -> int:
    return main(args)

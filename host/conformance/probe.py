"""The probe component: built from conformance/components/probe with inferlets/build.py into
build/conformance/probe.wasm (a no-op while its sources, the WIT and the SDK are unchanged)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "conformance" / "components" / "probe"
OUT = REPO / "build" / "conformance"


def probe_wasm() -> Path:
    spec = importlib.util.spec_from_file_location("pie_inferlet_build", REPO / "inferlets" / "build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    return build.build_one(SRC, OUT)

"""Where pie keeps things: the store under $PIE_HOME, the built inferlets, the shipped draft heads.

Every layer may read these; they import nothing of the host but its errors."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import InvalidArgument

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "build" / "inferlets"  # `make inferlets` writes <name>.wasm here
# Draft heads shipped with pie: host/drafter/heads/<name>/ (head.safetensors + drafter.json)
SHIPPED_DRAFTERS = Path(__file__).resolve().parent / "drafter" / "heads"


def pie_home() -> Path:
    return Path(os.environ.get("PIE_HOME") or Path.home() / ".cache" / "pie")


def models_dir() -> Path:
    return pie_home() / "models"


def drafters_dir() -> Path:
    """Where `pie drafter train` saves heads: $PIE_HOME/drafters/<name>/."""
    return pie_home() / "drafters"


def resolve_inferlet(name_or_path: str) -> Path:
    """A path to a .wasm, or the name of a built inferlet under build/inferlets/."""
    p = Path(name_or_path)
    if p.suffix == ".wasm" or p.is_file():
        if not p.is_file():
            raise InvalidArgument(f"{name_or_path}: no such file")
        return p
    built = BUILD / f"{name_or_path}.wasm"
    if built.is_file():
        return built
    if (ROOT / "inferlets" / name_or_path / "manifest.toml").is_file():
        raise InvalidArgument(f"inferlet {name_or_path!r} is not built; run `make inferlets`")
    known = sorted(w.stem for w in BUILD.glob("*.wasm")) if BUILD.is_dir() else []
    raise InvalidArgument(f"unknown inferlet {name_or_path!r}; built: {', '.join(known) or 'none (run `make inferlets`)'}")

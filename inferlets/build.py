"""Build every inferlet (a folder under inferlets/ with a manifest.toml) into build/inferlets/<name>.wasm.

A build is skipped when the sha256 of its inputs (the WIT, the SDK, the inferlet's sources)
matches the stamp beside the .wasm. Usage:
    python inferlets/build.py [NAME ...] [--src DIR] [--out DIR]
--src builds the inferlets under another folder (the tests build their own this way).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WIT = ROOT / "wit"
SDK = ROOT / "inferlets" / "sdk"
WORLD = "inferlet"


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts
                  and p.suffix not in (".pyc",))


def source_hash(src: Path, wit: Path = WIT) -> str:
    h = hashlib.sha256()
    for folder in (wit, SDK, src):
        for p in _files(folder):
            h.update(str(p.relative_to(folder)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def inferlet_dirs(src_root: Path) -> list[Path]:
    return sorted(p for p in src_root.iterdir() if (p / "manifest.toml").is_file())


def build_one(src: Path, out_dir: Path, wit: Path = WIT, world: str = WORLD, quiet: bool = True) -> Path:
    """Build `src` (a folder holding app.py) unless its stamp is current; returns the .wasm path."""
    src, out_dir, wit = src.resolve(), out_dir.resolve(), wit.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    wasm = out_dir / f"{src.name}.wasm"
    stamp = out_dir / f"{src.name}.sha256"
    digest = source_hash(src, wit)
    if wasm.is_file() and stamp.is_file() and stamp.read_text().strip() == digest:
        return wasm
    exe = Path(sys.executable).with_name("componentize-py")
    cmd = [str(exe) if exe.exists() else "componentize-py", "-d", str(wit), "-w", world]
    if quiet:
        cmd.append("-q")
    tmp = wasm.with_suffix(".wasm.tmp")
    cmd += ["componentize", "-p", str(SDK), "-p", str(src), "app", "-o", str(tmp)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=str(src))
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        # keep the error and its causes, drop componentize-py's native backtrace
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        cut = next((i for i, ln in enumerate(lines) if ln.strip() == "Stack backtrace:"), len(lines))
        raise RuntimeError(f"componentize-py failed for {src.name}:\n" + "\n".join(lines[:cut]).strip())
    os.replace(tmp, wasm)
    stamp.write_text(digest + "\n")
    return wasm


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help="inferlets to build (default: all)")
    ap.add_argument("--src", type=Path, default=ROOT / "inferlets")
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "inferlets")
    args = ap.parse_args(argv)
    dirs = inferlet_dirs(args.src)
    if args.names:
        known = {d.name: d for d in dirs}
        missing = [n for n in args.names if n not in known]
        if missing:
            print(f"unknown inferlet(s): {', '.join(missing)}; known: {', '.join(known)}", file=sys.stderr)
            return 2
        dirs = [known[n] for n in args.names]
    for d in dirs:
        try:
            wasm = build_one(d, args.out)
        except RuntimeError as e:
            print(e, file=sys.stderr)
            return 1
        print(f"{d.name}: {wasm.relative_to(ROOT) if wasm.is_relative_to(ROOT) else wasm}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

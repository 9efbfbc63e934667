"""The inferlets a server can launch: the built inferlets (build/inferlets/NAME.wasm) and the
components clients uploaded, each known by the sha256 of its bytes."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import tempfile
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import PieError
from ..runtime.runtime import Runtime
from .errors import BadRequest, NotFound

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
HASH = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Inferlet:
    name: str | None  # a built-in's name, or the name its last upload gave (None: known by hash only)
    hash: str  # sha256 of the .wasm
    bytes: int
    builtin: bool
    path: Path

    def card(self) -> dict:
        out = asdict(self) | {"object": "inferlet"}
        del out["path"]  # the server's files are not the client's business
        return out

    @property
    def run_name(self) -> str:
        """The name the run reports (RunResult.inferlet), as `pie run PATH` names it: the file's stem."""
        return self.name or self.hash[:12]


class Inferlets:
    """Built-ins are read from `builtin_dir` at each lookup (`make inferlets` may rebuild them);
    uploads are kept in `upload_dir` as HASH.wasm with a HASH.json naming them, so they outlive
    the server. Compiling goes through Runtime.load: once per content, cached on disk."""

    def __init__(self, runtime: Runtime, builtin_dir: Path, upload_dir: Path, max_bytes: int):
        self.runtime, self.builtin_dir, self.upload_dir, self.max_bytes = runtime, builtin_dir, upload_dir, max_bytes
        self._hashes: dict[Path, tuple[tuple[int, int], str]] = {}  # built-in -> ((mtime, size), sha256)
        self._lock = threading.Lock()

    def _builtins(self) -> list[Inferlet]:
        out = []
        for path in sorted(self.builtin_dir.glob("*.wasm")) if self.builtin_dir.is_dir() else []:
            st = path.stat()
            stamp = (st.st_mtime_ns, st.st_size)
            seen = self._hashes.get(path)
            if seen is None or seen[0] != stamp:
                seen = self._hashes[path] = (stamp, hashlib.sha256(path.read_bytes()).hexdigest())
            out.append(Inferlet(path.stem, seen[1], st.st_size, True, path))
        return out

    def _uploads(self) -> list[Inferlet]:
        out = []
        for path in sorted(self.upload_dir.glob("*.wasm")) if self.upload_dir.is_dir() else []:
            if not HASH.fullmatch(path.stem):
                continue
            try:
                name = json.loads(path.with_suffix(".json").read_text()).get("name")
            except (OSError, ValueError):
                name = None
            out.append(Inferlet(name, path.stem, path.stat().st_size, False, path))
        return out

    def list(self) -> list[Inferlet]:
        return self._builtins() + self._uploads()

    def resolve(self, name_or_hash: str) -> Inferlet:
        """By hash, else by name: a built-in's first, then an upload's (the latest named so)."""
        progs = self.list()
        for p in progs:
            if p.hash == name_or_hash:
                return p
        named = [p for p in progs if p.name == name_or_hash]
        if named:
            return named[0] if named[0].builtin else max(named, key=lambda p: p.path.stat().st_mtime_ns)
        raise NotFound(f"no inferlet {name_or_hash!r}: not a built-in's name, nor an upload's name or sha256 "
                       "(GET /v1/inferlets lists them)", param="inferlet", code="inferlet_not_found")

    async def upload(self, wasm: bytes, name: str | None) -> tuple[Inferlet, bool]:
        """Check and compile `wasm` (a bad component is refused with the runtime's message), then
        keep it; (the inferlet, whether it was new). A second upload of the same bytes only renames it."""
        if name is not None and not NAME.fullmatch(name):
            raise BadRequest(f"name {name!r}: 1 to 64 letters, digits, '.', '_' or '-'", param="name")
        digest = hashlib.sha256(wasm).hexdigest()
        try:  # compiling takes seconds the first time: off the event loop
            await asyncio.to_thread(self.runtime.load, wasm)
        except PieError as e:
            raise BadRequest(f"{e.code}: {e}", param="file", code="invalid_inferlet") from None
        path = self.upload_dir / f"{digest}.wasm"
        with self._lock:
            new = not path.is_file()
            if new:
                _write(path, wasm)
            if new or name is not None:
                _write(path.with_suffix(".json"), json.dumps({"name": name}).encode())
        return next(p for p in self._uploads() if p.hash == digest), new


def _write(path: Path, data: bytes) -> None:
    """Whole or not at all: a crash mid-write leaves no half component under its hash."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)

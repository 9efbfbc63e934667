"""Compiled-component cache: a Component's serialization keyed by the .wasm's sha256.

Compiling a componentize-py component takes seconds; deserializing the cached artifact takes
milliseconds. The key includes the wasmtime version, so an upgrade never loads a stale artifact.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import tempfile
from pathlib import Path

import wasmtime
from wasmtime.component import Component

from ..paths import pie_home
from .errors import InferletError

_WASM_MAGIC = b"\0asm"
KEEP = 16  # artifacts kept in the cache folder


def _wasmtime_version() -> str:
    try:
        return importlib.metadata.version("wasmtime")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def check_header(wasm: bytes) -> None:
    """A clear error for what is not a component, before wasmtime's terser one."""
    if len(wasm) < 8 or wasm[:4] != _WASM_MAGIC:
        raise InferletError("not a WebAssembly file (no \\0asm header); build the inferlet with componentize-py")
    if wasm[6:8] == b"\0\0":  # layer 0: a core module
        raise InferletError("this is a core WebAssembly module, not a component; "
                            "inferlets must be components of the pie:inferlet world (build with componentize-py)")


class ComponentCache:
    def __init__(self, engine: wasmtime.Engine, directory: Path | None = None):
        self.engine = engine
        self.dir = Path(directory) if directory else pie_home() / "cache" / "components"
        self._loaded: dict[str, Component] = {}  # this process's compiled components

    def key(self, wasm: bytes) -> str:
        h = hashlib.sha256(wasm)
        h.update(b"\0wasmtime-" + _wasmtime_version().encode())
        return h.hexdigest()

    def load(self, wasm: bytes) -> tuple[Component, str]:
        """The compiled component and its key; compiles and stores it on first sight."""
        check_header(wasm)
        key = self.key(wasm)
        if key in self._loaded:
            return self._loaded[key], key
        path = self.dir / f"{key}.cwasm"
        component = None
        if path.is_file():
            try:
                component = Component.deserialize_file(self.engine, str(path))
            except wasmtime.WasmtimeError:
                path.unlink(missing_ok=True)  # stale or corrupt: recompile below
        if component is None:
            try:
                component = Component(self.engine, wasm)
            except wasmtime.WasmtimeError as e:
                first = str(e).strip().splitlines()[0] if str(e).strip() else "invalid component"
                raise InferletError(f"the .wasm is not a valid component (truncated or corrupt?): {first}") from None
            self._store(path, component)
        self._loaded[key] = component
        return component, key

    def _store(self, path: Path, component: Component) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(component.serialize())
            os.replace(tmp, path)
            self._prune()
        except OSError:
            pass  # a read-only cache only costs the next launch a compile

    def _prune(self) -> None:
        """Keep the most recently written artifacts (each is tens of MB): rebuilt inferlets leave old ones."""
        old = sorted(self.dir.glob("*.cwasm"), key=lambda p: p.stat().st_mtime, reverse=True)[KEEP:]
        for p in old:
            p.unlink(missing_ok=True)

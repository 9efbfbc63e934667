"""Compiled-component cache: a Component's serialization keyed by the .wasm's sha256.

Compiling a componentize-py component takes seconds; deserializing the cached artifact takes
milliseconds. The key includes the wasmtime version, so an upgrade never loads a stale artifact.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import tempfile
from collections import OrderedDict
from pathlib import Path

import wasmtime
from wasmtime.component import Component

from ..paths import pie_home
from .errors import InferletError

_WASM_MAGIC = b"\0asm"
KEEP = 16  # artifacts kept in the cache folder
MAX_LOADED = 16  # compiled components kept in memory (pie serve --max-loaded-components)


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
    """The disk cache (every checked component, the newest KEEP) and, in memory, the `max_loaded`
    most recently used compiled components (each holds tens of MB). Not thread-safe: Runtime.load
    calls get/put under its lock and compile outside it."""

    def __init__(self, engine: wasmtime.Engine, directory: Path | None = None, max_loaded: int = MAX_LOADED):
        self.engine = engine
        self.dir = Path(directory) if directory else pie_home() / "cache" / "components"
        self.max_loaded = max_loaded
        self._loaded: OrderedDict[str, Component] = OrderedDict()  # LRU: the most recent last

    def key(self, wasm: bytes) -> str:
        h = hashlib.sha256(wasm)
        h.update(b"\0wasmtime-" + _wasmtime_version().encode())
        return h.hexdigest()

    def get(self, key: str) -> Component | None:
        component = self._loaded.get(key)
        if component is not None:
            self._loaded.move_to_end(key)
        return component

    def put(self, key: str, component: Component) -> None:
        self._loaded[key] = component
        self._loaded.move_to_end(key)
        while len(self._loaded) > self.max_loaded:
            self._loaded.popitem(last=False)  # the disk cache still has it: milliseconds to bring back

    def compile(self, wasm: bytes, key: str) -> tuple[Component, bool]:
        """The component from the disk cache, else compiled; (it, whether it was compiled). Nothing
        is kept: the caller checks it first, then `store`s and `put`s it."""
        path = self.dir / f"{key}.cwasm"
        if path.is_file():
            try:
                return Component.deserialize_file(self.engine, str(path)), False
            except wasmtime.WasmtimeError:
                path.unlink(missing_ok=True)  # stale or corrupt: recompile below
        try:
            return Component(self.engine, wasm), True
        except wasmtime.WasmtimeError as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else "invalid component"
            raise InferletError(f"the .wasm is not a valid component (truncated or corrupt?): {first}") from None

    def store(self, key: str, component: Component) -> None:
        self._store(self.dir / f"{key}.cwasm", component)

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

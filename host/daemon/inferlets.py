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
from typing import Protocol

from ..errors import PieError
from ..runtime.runtime import Runtime
from .errors import BadRequest, NotFound, QuotaExceeded, TooLarge
from .limits import ServeLimits

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
HASH = re.compile(r"[0-9a-f]{64}")
ANYONE = "anyone"  # the one owner of a server without API keys


@dataclass(frozen=True)
class Inferlet:
    name: str | None  # a built-in's name, or the name its owner gave it (None: known by hash only)
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

    @property
    def metric_label(self) -> str:
        """Its `inferlet` label in /metrics: a built-in's name; `custom` for every upload, so the
        open metrics name no tenant's uploads and the labels stay few."""
        return self.name if self.builtin else "custom"


Index = dict[str, str | None]  # one key's uploads: sha256 -> the name it gave (None: known by hash)


def with_upload(index: Index, digest: str, name: str | None) -> Index:
    """`index` after an upload of `digest`, named `name` or not: a name is one upload's, so
    another of the key's loses it; an unnamed upload keeps the name it had."""
    if name is not None:
        index = {h: (None if n == name else n) for h, n in index.items()}
    return index | {digest: name if name is not None else index.get(digest)}


class Shelf(Protocol):
    """Where the replicas of a deployment share their uploads (host.cluster.shelf: Ray's object
    store), so that one uploaded to any replica is launchable on every machine. Each replica's
    `upload_dir` is then a cache of it, filled on first use."""

    async def index(self, owner: str | None) -> Index: ...

    async def publish(self, owner: str | None, digest: str, name: str | None, wasm: bytes) -> Index:
        """An upload (with_upload's rule); the key's index after it."""

    async def add(self, owner: str | None, entries: Index, blobs: dict[str, bytes]) -> Index:
        """Uploads one replica held and the shelf did not (kept from before the deployment): added
        where their hash is new, their names where no other upload holds them; the key's index."""

    async def blob(self, digest: str) -> bytes | None: ...


class Inferlets:
    """Built-ins are read from `builtin_dir` at each lookup (`make inferlets` may rebuild them);
    uploads are kept in `upload_dir` as HASH.wasm (one file per content, whoever uploaded it) and
    owners/OWNER.json (each key's uploads and their names), so they outlive the server.
    Compiling goes through Runtime.load: once per content, cached on disk. With a `shelf`
    (a replica of a deployment), the shelf holds the uploads and `upload_dir` is a cache of it."""

    def __init__(self, runtime: Runtime, builtin_dir: Path, upload_dir: Path, max_bytes: int,
                 max_count: int = ServeLimits.uploads_per_key, max_total: int = ServeLimits.upload_storage_per_key,
                 shelf: Shelf | None = None):
        self.runtime, self.builtin_dir, self.upload_dir, self.max_bytes = runtime, builtin_dir, upload_dir, max_bytes
        self.shelf = shelf
        self.max_count, self.max_total = max_count, max_total  # per key: stored uploads and their bytes
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

    def _index_path(self, owner: str | None) -> Path:
        return self.upload_dir / "owners" / f"{owner or ANYONE}.json"

    def _index(self, owner: str | None) -> Index:
        """The owner's uploads: sha256 -> the name it gave (names are per key; bytes are shared)."""
        try:
            uploads = json.loads(self._index_path(owner).read_text()).get("uploads", {})
        except (OSError, ValueError):
            return {}
        return {h: n for h, n in uploads.items() if HASH.fullmatch(h)}

    def _uploads(self, owner: str | None) -> list[Inferlet]:
        out = []
        for digest, name in sorted(self._index(owner).items()):
            path = self._path(digest)
            if path.is_file():
                out.append(Inferlet(name, digest, path.stat().st_size, False, path))
        return out

    def list(self, owner: str | None = None) -> list[Inferlet]:
        """The built-ins and `owner`'s uploads (without keys, every client is one owner)."""
        return self._builtins() + self._uploads(owner)

    def resolve(self, name_or_hash: str, owner: str | None = None) -> Inferlet:
        """By hash, else by name: a built-in's first, then one of `owner`'s uploads; never another key's."""
        progs = self.list(owner)
        for p in progs:
            if p.hash == name_or_hash:
                return p
        for p in progs:
            if p.name == name_or_hash:
                return p
        raise NotFound(f"no inferlet {name_or_hash!r}: not a built-in's name, nor the name or sha256 of one of "
                       "your uploads (GET /v1/inferlets lists them)", param="inferlet", code="inferlet_not_found")

    async def find(self, name_or_hash: str, owner: str | None = None) -> Inferlet:
        """resolve, after the shelf's news for `owner` (an upload or a rename on another replica)."""
        if self.shelf is not None and not any(name_or_hash in (b.name, b.hash) for b in self._builtins()):
            await self.refresh(owner)
        return self.resolve(name_or_hash, owner)

    async def listing(self, owner: str | None = None) -> list[Inferlet]:
        """list, after the shelf's news for `owner`."""
        await self.refresh(owner)
        return self.list(owner)

    async def refresh(self, owner: str | None) -> None:
        """Bring `owner`'s uploads from the shelf into `upload_dir`: its index, and the components
        this machine lacks (checked against their hash). Uploads only this machine held go to the
        shelf first. Without a shelf, nothing to do."""
        if self.shelf is None:
            return
        shared, local = await self.shelf.index(owner), self._index(owner)
        ours = {h: n for h, n in local.items() if h not in shared and self._path(h).is_file()}
        if ours:
            shared = await self.shelf.add(owner, ours, {h: self._path(h).read_bytes() for h in ours})
        for digest in shared:
            if not self._path(digest).is_file():
                wasm = await self.shelf.blob(digest)
                if wasm is not None and hashlib.sha256(wasm).hexdigest() == digest:
                    _write(self._path(digest), wasm)
        if shared != local:
            with self._lock:
                self._write_index(owner, shared)

    def _path(self, digest: str) -> Path:
        return self.upload_dir / f"{digest}.wasm"

    def _write_index(self, owner: str | None, index: Index) -> None:
        """The caller holds the lock."""
        _write(self._index_path(owner), json.dumps({"uploads": index}).encode())

    def _check_quota(self, owner: str | None, digest: str, size: int) -> None:
        index = self._index(owner)
        if digest in index:
            return  # a rename or a second upload of the same bytes costs nothing more
        if len(index) + 1 > self.max_count:
            raise QuotaExceeded(f"this key holds {len(index)} uploads, this server's limit "
                                "(pie serve --max-uploads-per-key)")
        held = sum(p.bytes for p in self._uploads(owner))
        if held + size > self.max_total:
            raise TooLarge(f"this key's uploads would take {held + size} bytes, past this server's limit of "
                           f"{self.max_total >> 20} MiB per key (pie serve --max-upload-storage-mb)",
                           code="upload_quota_exceeded")

    async def upload(self, wasm: bytes, name: str | None, owner: str | None = None) -> tuple[Inferlet, bool]:
        """Check and compile `wasm` (a bad component is refused with the runtime's message), then
        keep it for `owner`; (the inferlet, whether it was new to the owner). A second upload of the
        same bytes only renames it. Past the owner's quota, refused before compiling."""
        if name is not None and not NAME.fullmatch(name):
            raise BadRequest(f"name {name!r}: 1 to 64 letters, digits, '.', '_' or '-'", param="name")
        digest = hashlib.sha256(wasm).hexdigest()
        await self.refresh(owner)  # the quota counts the key's uploads on every replica
        self._check_quota(owner, digest, len(wasm))
        try:  # compiling takes seconds the first time: off the event loop
            await asyncio.to_thread(self.runtime.load, wasm)
        except PieError as e:
            raise BadRequest(f"{e.code}: {e}", param="file", code="invalid_inferlet") from None
        path = self._path(digest)
        with self._lock:
            self._check_quota(owner, digest, len(wasm))  # another upload of this key may have finished meanwhile
            if not path.is_file():
                _write(path, wasm)
            index = self._index(owner)
            new = digest not in index
            if self.shelf is None and (new or name is not None):
                self._write_index(owner, with_upload(index, digest, name))
        if self.shelf is not None:  # the shelf applies the same rule to the deployment's index
            index = await self.shelf.publish(owner, digest, name, wasm)
            with self._lock:
                self._write_index(owner, index)
        return next(p for p in self._uploads(owner) if p.hash == digest), new


def _write(path: Path, data: bytes) -> None:
    """Whole or not at all: a crash mid-write leaves no half component under its hash."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)

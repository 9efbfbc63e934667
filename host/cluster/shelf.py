"""The deployment's uploads: a Ray actor holding every key's index and each component's bytes in
Ray's object store, so that a component uploaded to one replica can be launched on any machine.
Each replica's upload folder is a cache of it (host.daemon.inferlets.Inferlets.refresh)."""

from __future__ import annotations

import ray

from ..daemon.inferlets import Index, with_upload


class Shelves:
    """The shelf's state and rules, apart from Ray: every key's index, and the components."""

    def __init__(self):
        self.blobs: dict = {}  # sha256 -> the bytes (the actor: their reference in the object store)
        self.owners: dict[str | None, Index] = {}

    def _keep(self, digest: str, wasm: bytes) -> None:
        self.blobs.setdefault(digest, wasm)

    def index(self, owner: str | None) -> Index:
        return dict(self.owners.get(owner, {}))

    def publish(self, owner: str | None, digest: str, name: str | None, wasm: bytes) -> Index:
        self._keep(digest, wasm)
        self.owners[owner] = with_upload(self.owners.get(owner, {}), digest, name)
        return self.index(owner)

    def add(self, owner: str | None, entries: Index, blobs: dict[str, bytes]) -> Index:
        index = self.owners.setdefault(owner, {})
        for digest, name in entries.items():
            if digest in index or digest not in blobs:
                continue
            self._keep(digest, blobs[digest])
            index[digest] = name if name not in index.values() else None
        return self.index(owner)

    def blob(self, digest: str):
        return self.blobs.get(digest)


@ray.remote(num_cpus=0)
class ShelfActor(Shelves):
    def _keep(self, digest: str, wasm: bytes) -> None:
        if digest not in self.blobs:  # put by this actor, so owned by it: kept while it lives
            self.blobs[digest] = ray.put(wasm)

    def blob(self, digest: str) -> list[ray.ObjectRef]:
        """[the bytes' reference] (a list, so that Ray hands the reference over, not the bytes:
        the replica fetches them from the nearest copy), or []."""
        return [self.blobs[digest]] if digest in self.blobs else []


class RayShelf:
    """host.daemon.inferlets.Shelf over the actor's handle."""

    def __init__(self, handle):
        self.handle = handle

    async def index(self, owner: str | None) -> Index:
        return await self.handle.index.remote(owner)

    async def publish(self, owner: str | None, digest: str, name: str | None, wasm: bytes) -> Index:
        return await self.handle.publish.remote(owner, digest, name, wasm)

    async def add(self, owner: str | None, entries: Index, blobs: dict[str, bytes]) -> Index:
        return await self.handle.add.remote(owner, entries, blobs)

    async def blob(self, digest: str) -> bytes | None:
        refs = await self.handle.blob.remote(digest)
        return await refs[0] if refs else None

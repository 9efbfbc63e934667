"""Uploads shared by a deployment's replicas through a shelf (host.cluster.shelf), without Ray:
each replica's Inferlets has a folder of its own (as on machines of their own) and one shelf
between them. test_cluster.py runs the same through the Ray actor."""

from __future__ import annotations

import asyncio
import hashlib

import pytest

from host.cluster.shelf import Shelves
from host.daemon.errors import NotFound, QuotaExceeded
from host.daemon.inferlets import Inferlets
from wasm_fixtures import *  # noqa: F401,F403

pytestmark = [pytest.mark.model, pytest.mark.wasm]


class InProcess:
    """The Shelf protocol over Shelves, as RayShelf is over the actor; `corrupt` damages what it hands out."""

    def __init__(self):
        self.s, self.corrupt, self.fetched = Shelves(), False, []

    async def index(self, owner):
        return self.s.index(owner)

    async def publish(self, owner, digest, name, wasm):
        return self.s.publish(owner, digest, name, wasm)

    async def add(self, owner, entries, blobs):
        return self.s.add(owner, entries, blobs)

    async def blob(self, digest):
        self.fetched.append(digest)
        wasm = self.s.blob(digest)
        return wasm[:-1] + b"x" if wasm is not None and self.corrupt else wasm


@pytest.fixture
def replicas(runtime, tmp_path):
    shelf = InProcess()

    def replica(name, max_count=8, with_shelf=True):
        return Inferlets(runtime, tmp_path / "builtin", tmp_path / name, 1 << 30, max_count=max_count,
                         shelf=shelf if with_shelf else None)

    return shelf, replica


def _run(coro):
    return asyncio.run(coro)


def test_an_upload_on_one_replica_is_installed_on_another_on_first_use(replicas, misbehave_wasm):
    shelf, replica = replicas
    a, b = replica("a"), replica("b")
    wasm = misbehave_wasm.read_bytes()
    up, new = _run(a.upload(wasm, "mine", "k1"))
    assert new and up.hash == hashlib.sha256(wasm).hexdigest()
    assert not (b.upload_dir / f"{up.hash}.wasm").exists() and shelf.fetched == []
    found = _run(b.find("mine", "k1"))
    assert (found.hash, found.name, found.builtin) == (up.hash, "mine", False)
    assert found.path.read_bytes() == wasm and shelf.fetched == [up.hash]
    assert [p.hash for p in _run(b.listing("k1"))] == [up.hash]
    _run(b.find(up.hash, "k1"))
    assert shelf.fetched == [up.hash]  # installed once
    with pytest.raises(NotFound):  # another key's uploads stay its own
        _run(b.find("mine", "k2"))
    assert _run(b.listing("k2")) == []


def test_a_rename_on_one_replica_is_seen_on_the_other(replicas, misbehave_wasm, text_completion_wasm):
    _, replica = replicas
    a, b = replica("a"), replica("b")
    first = _run(a.upload(misbehave_wasm.read_bytes(), "mine", "k"))[0]
    _run(b.find("mine", "k"))
    second, new = _run(b.upload(text_completion_wasm.read_bytes(), "mine", "k"))  # the name moves to other bytes
    assert new
    assert _run(a.find("mine", "k")).hash == second.hash
    assert {p.hash: p.name for p in _run(a.listing("k"))} == {first.hash: None, second.hash: "mine"}
    again, new = _run(a.upload(misbehave_wasm.read_bytes(), None, "k"))  # same bytes, no name: nothing changes
    assert not new and again.name is None


def test_uploads_a_replica_held_before_the_deployment_are_shared(replicas, misbehave_wasm, text_completion_wasm):
    _, replica = replicas
    a = replica("a")
    _run(a.upload(misbehave_wasm.read_bytes(), "mine", "k"))
    before = replica("c", with_shelf=False)  # a server of its own, before it joined the deployment
    old = _run(before.upload(text_completion_wasm.read_bytes(), "mine", "k"))[0]
    c = replica("c")
    held = {p.hash: p.name for p in _run(c.listing("k"))}
    # shared now, under no name: the deployment's "mine" is another upload's
    assert held == {hashlib.sha256(misbehave_wasm.read_bytes()).hexdigest(): "mine", old.hash: None}
    assert _run(a.find(old.hash, "k")).path.read_bytes() == text_completion_wasm.read_bytes()


def test_a_damaged_component_is_not_installed(replicas, misbehave_wasm):
    shelf, replica = replicas
    up = _run(replica("a").upload(misbehave_wasm.read_bytes(), "mine", "k"))[0]
    shelf.corrupt = True
    b = replica("b")
    with pytest.raises(NotFound):
        _run(b.find("mine", "k"))
    assert not (b.upload_dir / f"{up.hash}.wasm").exists()
    shelf.corrupt = False
    assert _run(b.find("mine", "k")).hash == up.hash


def test_the_quota_counts_a_keys_uploads_on_every_replica(replicas, misbehave_wasm, text_completion_wasm):
    _, replica = replicas
    _run(replica("a", max_count=1).upload(misbehave_wasm.read_bytes(), None, "k"))
    with pytest.raises(QuotaExceeded):
        _run(replica("b", max_count=1).upload(text_completion_wasm.read_bytes(), None, "k"))

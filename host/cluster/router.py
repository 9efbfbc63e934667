"""The deployment's request router: every call on an instance goes to the replica that runs it
(its id names the replica); a completion whose conversation has a key (prefix affinity) to that
key's replica while its queue is no more than `slack` requests past the shortest, so that its
next turn finds its prompt in that replica's prefix cache; any other request to the less loaded
of two random replicas, Ray Serve's power of two choices.

The router sees a request's metadata, not its path or body (its route is the FastAPI template,
/v1/instances/{instance_id}), so the proxy's middleware (proxy.py) writes the pin or the key into
the one header the proxy copies there: Ray Serve's session id, as PIN + the replica's id or
AFFINE + the key."""

from __future__ import annotations

import hashlib
import random
from dataclasses import asdict, dataclass

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from ..daemon.ids import INSTANCE_ID

PREFIX = "/v1/instances/"
PIN = "pie-pin:"  # a session id that pins the request to a replica
AFFINE = "pie-affine:"  # a session id naming a conversation (proxy.affinity_key)
SLACK = 2  # default: the key's replica is passed over once its queue is this much past the shortest


def pinned_replica(path: str) -> str | None:
    """The replica an instance's path names (/v1/instances/ID[/...]); None for any other path."""
    if not path.startswith(PREFIX):
        return None
    m = INSTANCE_ID.fullmatch(path[len(PREFIX):].split("/", 1)[0])
    return m.group(1) if m else None


@dataclass(frozen=True)
class Routing:
    """The router's settings (`pie serve --affinity`, `--affinity-slack`)."""

    affinity: bool = True  # a conversation's turns to one replica
    slack: int = SLACK

    def kwargs(self) -> dict:  # PinnedRouter.initialize_state's
        return asdict(self)


def affine(key: str, replicas: list[str]) -> str:
    """The key's replica among `replicas` (ids): the highest of hash(key, replica), rendezvous
    hashing, so a replica that comes or goes moves only its own share of the keys."""
    return max(replicas, key=lambda r: hashlib.sha256(f"{key}/{r}".encode()).digest())


class PinnedRouter(RequestRouter):
    """No FIFO mixin: a routing task fulfils the very request it was started for, so a pinned
    request never takes another's replica."""

    affinity, slack = True, SLACK

    def initialize_state(self, affinity: bool = True, slack: int = SLACK, **kwargs):
        """affinity: route a conversation's turns to one replica (`pie serve --affinity`)."""
        self.affinity, self.slack = affinity, slack

    async def _queue_lens(self, replicas: list[RunningReplica]) -> dict:
        """Each replica's ongoing requests (from Ray's cache, else asked; a replica that does not
        answer is left out)."""
        out, ask = {}, []
        for r in replicas:
            n = self._replica_queue_len_cache.get(r.replica_id) if self._use_replica_queue_len_cache else None
            if n is None:
                ask.append(r)
            else:
                out[r.replica_id] = n
        if ask:
            out |= {r.replica_id: n for r, n in await self._probe_queue_lens(ask, 0) if n is not None}
        return out

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        session = pending_request.metadata.session_id if pending_request is not None else ""
        want = session.removeprefix(PIN) if session.startswith(PIN) else None
        if want is not None:
            match = [r for r in candidate_replicas if r.replica_id.unique_id == want]
            if match:
                return [match]
            # its replica is gone: any replica answers, with the 404 of an unknown instance
        two = random.sample(candidate_replicas, min(2, len(candidate_replicas)))  # it takes the shorter queue
        if session.startswith(AFFINE) and self.affinity and len(candidate_replicas) > 1:
            want = affine(session.removeprefix(AFFINE), [r.replica_id.unique_id for r in candidate_replicas])
            best = next(r for r in candidate_replicas if r.replica_id.unique_id == want)
            lens = await self._queue_lens(candidate_replicas)
            if best.replica_id in lens and lens[best.replica_id] - min(lens.values()) <= self.slack:
                return [[best], two]  # the second rank if the first is at capacity
        return [two]

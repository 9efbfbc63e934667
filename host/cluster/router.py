"""The deployment's request router: every call on an instance goes to the replica that runs it
(its id names the replica); any other request to the less loaded of two random replicas, Ray
Serve's power of two choices.

The router sees a request's metadata, not its path (its route is the FastAPI template,
/v1/instances/{instance_id}), so the proxy's middleware (proxy.py) writes the pin into the one
header the proxy copies there: Ray Serve's session id, as PIN + the replica's id."""

from __future__ import annotations

import random

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from ..daemon.ids import INSTANCE_ID

PREFIX = "/v1/instances/"
PIN = "pie-pin:"  # a session id that pins the request to a replica


def pinned_replica(path: str) -> str | None:
    """The replica an instance's path names (/v1/instances/ID[/...]); None for any other path."""
    if not path.startswith(PREFIX):
        return None
    m = INSTANCE_ID.fullmatch(path[len(PREFIX):].split("/", 1)[0])
    return m.group(1) if m else None


class PinnedRouter(RequestRouter):
    """No FIFO mixin: a routing task fulfils the very request it was started for, so a pinned
    request never takes another's replica."""

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
        two = random.sample(candidate_replicas, min(2, len(candidate_replicas)))
        return [two]  # the router takes the one with the shorter queue

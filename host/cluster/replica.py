"""One replica of the deployment: the server of `pie serve` (its engine, runtime, service and
FastAPI app), in a Ray Serve replica. It posts its state to the board, and answers /health and
/metrics for the whole deployment from the board's posts."""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, replace
from typing import Any, Callable

import ray
from ray import serve

from ..daemon.app import create_app
from ..daemon.service import ServeConfig, Service
from ..runtime.limits import Limits
from ..runtime.runtime import Runtime
from . import board as board_mod
from .metrics import merge
from .shelf import RayShelf

log = logging.getLogger("pie.serve")


@dataclass(frozen=True)
class ReplicaSpec:
    """Everything a replica needs to start, sent to it by Ray (so: picklable)."""

    engine: Callable[[], Any]  # builds the replica's Engine: a module-level function or a partial of one
    serve: ServeConfig
    limits: Limits  # each instance's (pie serve's flags)
    threads: int | None = None  # torch threads of the replica (None: torch's default)
    cache_dir: str | None = None  # compiled components (None: the runtime's default)
    board: str = "pie-board"  # the board actor's name (in board.NAMESPACE)
    shelf: str = "pie-shelf"  # the uploads' actor's name (shelf.py)


class Replica:
    def __init__(self, spec: ReplicaSpec):
        if not logging.getLogger().handlers:  # the request log, to the replica's stderr (and the driver's)
            logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        if spec.threads:
            import torch

            torch.set_num_threads(spec.threads)
        self.id = serve.get_replica_context().replica_id.unique_id
        self.node = ray.get_runtime_context().get_node_id()
        self.runtime = Runtime(spec.engine(), limits=spec.limits, cache_dir=spec.cache_dir)
        shelf = RayShelf(ray.get_actor(spec.shelf, namespace=board_mod.NAMESPACE))
        self.service = Service(self.runtime, replace(spec.serve, replica=self.id), shelf)
        self.board = ray.get_actor(spec.board, namespace=board_mod.NAMESPACE)
        self._stop = threading.Event()
        self._poster = threading.Thread(target=self._post_loop, name="pie-board-post", daemon=True)
        self._poster.start()
        log.info("replica %s serving %s", self.id, self.service.model)

    def __serve_build_asgi_app__(self):
        return create_app(self.service, self)

    def _health(self) -> dict:
        adm = self.service.admission
        return {"running": adm.running, "waiting": adm.waiting, "status": "shutting_down" if adm.closed else "ok",
                "node": self.node, "pid": os.getpid()}

    def _post(self) -> None:
        self.board.post.remote(self.id, self._health(), self.service.metrics.render())

    def _post_loop(self) -> None:
        self._post()
        while not self._stop.wait(board_mod.REPORT_S):
            try:
                self._post()
            except Exception:  # the board is gone (the deployment is shutting down)
                log.warning("replica %s could not post to the board", self.id, exc_info=True)

    async def health(self, local: dict) -> dict:
        """This replica's /health body, with the deployment's: every replica heard from lately,
        and the running and waiting totals over them."""
        posts = await self.board.read.remote()
        by = {r: p["health"] | {"age_s": round(p["age_s"], 3)} for r, p in posts.items()}
        by[self.id] = self._health() | {"age_s": 0.0}
        return local | {"replica": self.id, "replicas": len(by), "running": sum(h["running"] for h in by.values()),
                        "waiting": sum(h["waiting"] for h in by.values()), "by_replica": by}

    async def metrics(self, local: bytes) -> bytes:
        posts = await self.board.read.remote()
        texts = {r: p["metrics"] for r, p in posts.items()}
        texts[self.id] = local
        return merge(texts)

    def __del__(self):
        """Ray Serve's graceful shutdown: the instances are cancelled (their streams end), then
        the runtime stops."""
        if not hasattr(self, "_stop"):  # its start failed: nothing runs
            return
        self._stop.set()
        cancelled = self.service.instances.close(timeout=10)
        if cancelled:
            log.info("replica %s: cancelled %d running instance(s)", self.id, cancelled)
        try:
            self.board.leave.remote(self.id)
        except Exception:
            pass
        self.runtime.close()

"""The deployment's notice board: a Ray actor to which every replica posts its state once a
REPORT_S (its health and its /metrics text), so that any replica answers /health and /metrics
for the whole deployment. A replica silent for STALE_S is taken for gone."""

from __future__ import annotations

import time

import ray

REPORT_S = 1.0
STALE_S = 5.0
NAMESPACE = "pie"


@ray.remote(num_cpus=0)
class Board:
    def __init__(self):
        self.posts: dict[str, dict] = {}

    def post(self, replica: str, health: dict, metrics: bytes) -> None:
        self.posts[replica] = {"health": health, "metrics": metrics, "at": time.time()}

    def leave(self, replica: str) -> None:
        self.posts.pop(replica, None)

    def read(self) -> dict[str, dict]:
        """The replicas heard from in the last STALE_S: replica id -> {health, metrics, age_s}."""
        now = time.time()
        for r in [r for r, p in self.posts.items() if now - p["at"] > STALE_S]:
            del self.posts[r]
        return {r: {"health": p["health"], "metrics": p["metrics"], "age_s": now - p["at"]}
                for r, p in self.posts.items()}

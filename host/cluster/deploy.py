"""Starting the deployment: Ray Serve's proxy on the server's host and port, the replicas of
replica.py, the router of router.py, the board and the shelf; and `pie serve --replicas`' life around them."""

from __future__ import annotations

import logging
import os
import signal
import threading
from dataclasses import dataclass

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from .board import NAMESPACE, Board
from .replica import Replica, ReplicaSpec
from .router import PinnedRouter, Routing
from .shelf import ShelfActor

log = logging.getLogger("pie.serve")
APP = "pie"
# Read by Ray Serve's processes at their start: ours inherit them from here (a cluster started by
# `ray start` needs them in ray start's environment: docs/cluster.md)
PROXY_ENV = {
    "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "host.cluster.proxy.middlewares",
    # a proxy on a busy 2-core machine takes longer than Ray's 5 s to come up
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
    "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60",
}


@dataclass(frozen=True)
class Scale:
    """How many replicas: a fixed `replicas`, or autoscaling between min and max on Ray Serve's
    ongoing requests per replica."""

    replicas: int = 1
    cpus: float = 1.0  # logical CPUs a replica holds (fractional: several per core)
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None
    upscale_delay_s: float | None = None  # how long the load must call for more replicas (Ray's default 30)
    downscale_delay_s: float | None = None  # ... for fewer (Ray's default 600)

    def options(self) -> dict:
        if self.max_replicas is None:
            return {"num_replicas": self.replicas}
        auto = {"min_replicas": self.min_replicas if self.min_replicas is not None else 1,
                "max_replicas": self.max_replicas, "initial_replicas": self.replicas}
        for k in ("target_ongoing_requests", "upscale_delay_s", "downscale_delay_s"):
            if getattr(self, k) is not None:
                auto[k] = getattr(self, k)
        return {"autoscaling_config": auto}


def init_ray(address: str | None, num_cpus: float | None = None, log_to_driver: bool = True) -> None:
    """Join the cluster at `address` ("auto": the one `ray start` began here), or start one in
    this process with `num_cpus` logical CPUs. log_to_driver: the replicas' logs (one line per
    request, naming its replica) are printed here too."""
    for k, v in PROXY_ENV.items():
        os.environ.setdefault(k, v)
    env = {"env_vars": {k: os.environ[k] for k in [*PROXY_ENV, "PIE_HOME"] if k in os.environ}}
    if address is None:
        ray.init(num_cpus=num_cpus, namespace=NAMESPACE, include_dashboard=False, runtime_env=env,
                 log_to_driver=log_to_driver)
    else:
        ray.init(address=address, namespace=NAMESPACE, runtime_env=env, log_to_driver=log_to_driver)


_actors: list = []  # the board's and the shelf's handles: the actors live while this process holds them


def start(spec: ReplicaSpec, scale: Scale, host: str, port: int, routing: Routing = Routing()) -> None:
    """The board, the shelf, the proxy and the replicas, returning once every replica serves."""
    _actors[:] = [Board.options(name=spec.board, namespace=NAMESPACE, get_if_exists=True).remote(),
                  ShelfActor.options(name=spec.shelf, namespace=NAMESPACE, get_if_exists=True).remote()]
    serve.start(http_options={"host": host, "port": port})
    limits = spec.serve.limits
    dep = serve.deployment(serve.ingress()(Replica), name="pie", ray_actor_options={"num_cpus": scale.cpus},
                           # our admission queues and refuses (429): Ray's router must not hold requests first
                           max_ongoing_requests=limits.requests,
                           request_router_config=RequestRouterConfig(request_router_class=PinnedRouter,
                                                                     request_router_kwargs=routing.kwargs()),
                           graceful_shutdown_timeout_s=15, **scale.options())
    serve.run(dep.bind(spec), name=APP, route_prefix="/")


def stop() -> None:
    serve.shutdown()
    _actors.clear()
    ray.shutdown()


def serve_forever(spec: ReplicaSpec, scale: Scale, host: str, port: int, address: str | None,
                  routing: Routing = Routing()) -> None:
    """`pie serve --replicas`: start, then serve until SIGINT/SIGTERM, then shut the deployment
    down (each replica cancels its instances, as one server does)."""
    init_ray(address, None if address else max(os.cpu_count() or 1, scale.cpus * scale.replicas))
    try:
        start(spec, scale, host, port, routing)
        log.info("serving on http://%s:%d with %s replica(s)", host, port,
                 scale.replicas if scale.max_replicas is None else f"{scale.min_replicas}..{scale.max_replicas}")
        done = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: done.set())
        done.wait()
        log.info("shutting down the deployment")
    finally:
        stop()

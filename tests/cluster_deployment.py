"""A deployment of `pie serve --replicas` over the conformance suite's tiny model, in a process of
its own (test_cluster.py starts it): Ray's workers install signal handlers in the process that
calls ray.init, and those would take wasmtime's traps from the test process's own runtimes.

    python tests/cluster_deployment.py PORT UPLOAD_DIR

Prints `ready` once every replica serves; SIGTERM shuts the deployment and its Ray cluster down."""

from __future__ import annotations

import functools
import signal
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from host.cluster import deploy  # noqa: E402
from host.cluster.replica import ReplicaSpec  # noqa: E402
from host.conformance.models import suite_engine  # noqa: E402
from host.runtime.limits import Limits  # noqa: E402
from test_cluster import config  # noqa: E402
from wasm_fixtures import TEST_CACHE  # noqa: E402


def main(port: int, uploads: Path) -> None:
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    deploy.init_ray(None, num_cpus=4, log_to_driver=False)
    try:
        spec = ReplicaSpec(functools.partial(suite_engine, "tiny"), config(uploads), Limits(), threads=1,
                           cache_dir=str(TEST_CACHE))
        deploy.start(spec, deploy.Scale(replicas=2, cpus=0.5), "127.0.0.1", port)
        print("ready", flush=True)
        done.wait()
    finally:
        deploy.stop()


if __name__ == "__main__":
    main(int(sys.argv[1]), Path(sys.argv[2]))

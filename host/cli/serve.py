"""`pie serve [--model M] [--host H] [--port P] [--api-key-file F] [--max-instances N] [--max-queue N]
[--max-instances-per-key N] [--default-inferlet NAME]`, the client limits of host/daemon/limits.py
(--max-body-mb, --max-upload-mb, timeouts, ...) and each instance's of host/runtime/limits.py."""

from __future__ import annotations

import functools
import logging

from ..daemon import limits as serve_limits
from ..engine.suffix_index import SUFFIX_TOKENS
from ..runtime.limits import add_flags, from_args


def add_serve_parser(subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API",
                              description="Load the model once and serve /v1/models, /v1/completions, "
                                          "/v1/chat/completions, the inferlet API (/v1/inferlets, "
                                          "/v1/instances) and /metrics.")
    p.add_argument("--model", help="store model name (default: smollm2-135m)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--prefix-caching", default="auto", choices=["auto", "on", "off"],
                   help="reuse KV rows of earlier prompts with the same start (docs/prefix-caching.md); auto: where the engine's "
                        "rows are exact whatever their pass (CPU float32 with the kernels)")
    p.add_argument("--suffix-index-tokens", type=int, default=SUFFIX_TOKENS, metavar="N",
                   help="tokens of earlier requests' prompts and outputs kept for cross-request drafts, each API key's "
                        f"apart (cacheback-speculative-decoding; docs/prefix-caching.md; default {SUFFIX_TOKENS} over all keys; 0: off)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--api-key-file", help="bearer API keys, one a line (default: no authentication)")
    p.add_argument("--max-instances", type=int, default=8,
                   help="most instances running at once; past it a request waits in the queue (default 8)")
    p.add_argument("--max-queue", type=int, default=32,
                   help="most requests waiting for an instance slot; past it 429 with Retry-After (default 32)")
    p.add_argument("--max-instances-per-key", type=int, default=None,
                   help="most instances one API key has running and waiting; past it 429 (default: no limit)")
    p.add_argument("--metrics-need-key", action="store_true",
                   help="/metrics requires an API key too (default: open, as /health)")
    p.add_argument("--per-request-spec-decode-metrics", action="store_true",
                   help="every completion's answer ends with its speculation's metrics (`metrics`, as vLLM's); "
                        "a request may ask with `spec_decode_metrics: true` alone")
    p.add_argument("--default-inferlet", "--inferlet", dest="inferlet", default="text-completion",
                   help="the inferlet that serves completions which name none: a built name or a .wasm path")
    c = p.add_argument_group("scale-out on Ray Serve (pip install -e '.[cluster]'; docs/cluster.md)")
    c.add_argument("--replicas", type=int, default=None, metavar="N",
                   help="serve as a Ray Serve deployment of N replicas, each with its own engine and model, behind "
                        "Ray Serve's proxy on --host/--port (default: one server in this process, Ray unused)")
    c.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="the Ray cluster to join (auto: the one `ray start` began on this machine; default: start "
                        "one in this process)")
    c.add_argument("--replica-cpus", type=float, default=1.0, metavar="F",
                   help="logical CPUs each replica holds in Ray's scheduling, fractional allowed (default 1)")
    c.add_argument("--threads-per-replica", type=int, default=None, metavar="T",
                   help="torch threads of each replica (default: torch's own choice)")
    c.add_argument("--affinity", choices=["on", "off"], default="on",
                   help="on: a conversation's turns go to one replica (its prefix cache holds their prompt) while "
                        "its queue is at most --affinity-slack past the shortest; off: power of two choices "
                        "(default on)")
    c.add_argument("--affinity-slack", type=int, default=None, metavar="N",
                   help="requests a conversation's replica may be behind the least loaded before its turn goes "
                        "elsewhere (default 2)")
    c.add_argument("--min-replicas", type=int, default=None, help="autoscaling: fewest replicas (default 1)")
    c.add_argument("--max-replicas", type=int, default=None,
                   help="autoscaling: most replicas; set, Ray Serve scales between the two on ongoing requests")
    c.add_argument("--target-ongoing-requests", type=float, default=None,
                   help="autoscaling: requests a replica should have in flight (Ray Serve's default if unset)")
    c.add_argument("--upscale-delay-s", type=float, default=None,
                   help="autoscaling: seconds the load must call for more replicas before one starts (Ray's default 30)")
    c.add_argument("--downscale-delay-s", type=float, default=None,
                   help="autoscaling: seconds the load must call for fewer before one stops (Ray's default 600)")
    serve_limits.add_flags(p)  # what one client may cost before an instance runs
    add_flags(p)  # each instance's limits: a launch may ask for less, never more
    p.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    from ..errors import InvalidArgument
    from ..paths import resolve_inferlet
    from ..runtime.runtime import Runtime
    from ..store import open_engine
    from ..daemon.auth import load_keys
    from ..daemon.server import Daemon
    from ..daemon.service import ServeConfig, Service

    if args.max_instances < 1:
        raise InvalidArgument("--max-instances must be at least 1")
    if args.suffix_index_tokens < 0:
        raise InvalidArgument("--suffix-index-tokens must be at least 0")
    if args.max_queue < 0:
        raise InvalidArgument("--max-queue must be at least 0")
    if args.max_instances_per_key is not None and args.max_instances_per_key < 1:
        raise InvalidArgument("--max-instances-per-key must be at least 1")
    client_limits = serve_limits.from_args(args)
    config = ServeConfig(inferlet=resolve_inferlet(args.inferlet), max_instances=args.max_instances,
                         max_queue=args.max_queue, max_instances_per_key=args.max_instances_per_key,
                         api_keys=load_keys(args.api_key_file), max_upload_bytes=client_limits.upload_bytes,
                         metrics_need_key=args.metrics_need_key, spec_metrics=args.per_request_spec_decode_metrics,
                         limits=client_limits)
    limits = from_args(args)  # all checked before the model loads
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("pie.serve")
    make_engine = functools.partial(open_engine, args.model, device=args.device, dtype=args.dtype,
                                    prefix_caching={"auto": None, "on": True, "off": False}[args.prefix_caching],
                                    suffix_tokens=args.suffix_index_tokens)
    if args.replicas is not None or args.max_replicas is not None:
        return _serve_replicas(args, make_engine, config, limits)
    engine = make_engine()
    with Runtime(engine, limits=limits) as rt:
        service = Service(rt, config)
        log.info("serving %s with %s on http://%s:%d (%s; at most %d instances, %d waiting%s)", service.model,
                 config.inferlet.stem, args.host, args.port,
                 f"{len(config.api_keys)} API key(s)" if config.api_keys else "no authentication",
                 config.max_instances, config.max_queue,
                 f", {config.max_instances_per_key} per key" if config.max_instances_per_key else "")
        if not config.api_keys and args.host not in ("127.0.0.1", "localhost", "::1"):
            log.warning("serving on %s without API keys: anyone who can reach it can use it "
                        "(--api-key-file)", args.host)
        Daemon(service, args.host, args.port).run()
    return 0


def _serve_replicas(args, make_engine, config, limits) -> int:
    from ..errors import InvalidArgument

    try:
        from ..cluster.deploy import Scale, serve_forever
        from ..cluster.replica import ReplicaSpec
        from ..cluster.router import SLACK, Routing
    except ImportError as e:
        raise InvalidArgument(f"--replicas needs Ray Serve: pip install -e '.[cluster]' ({e})") from None
    replicas = args.replicas if args.replicas is not None else (args.min_replicas or 1)
    if replicas < 1:
        raise InvalidArgument("--replicas must be at least 1")
    if args.replica_cpus <= 0:
        raise InvalidArgument("--replica-cpus must be more than 0")
    if args.threads_per_replica is not None and args.threads_per_replica < 1:
        raise InvalidArgument("--threads-per-replica must be at least 1")
    if args.max_replicas is not None and not (args.min_replicas or 1) <= replicas <= args.max_replicas:
        raise InvalidArgument("autoscaling needs --min-replicas <= --replicas <= --max-replicas")
    slack = SLACK if args.affinity_slack is None else args.affinity_slack
    if slack < 0:
        raise InvalidArgument("--affinity-slack must be at least 0")
    routing = Routing(args.affinity == "on", slack)
    if any(x is not None and x < 0 for x in (args.upscale_delay_s, args.downscale_delay_s)):
        raise InvalidArgument("--upscale-delay-s and --downscale-delay-s must be at least 0")
    scale = Scale(replicas, args.replica_cpus, args.min_replicas, args.max_replicas, args.target_ongoing_requests,
                  args.upscale_delay_s, args.downscale_delay_s)
    spec = ReplicaSpec(make_engine, config, limits, threads=args.threads_per_replica)
    serve_forever(spec, scale, args.host, args.port, args.ray_address, routing)
    return 0

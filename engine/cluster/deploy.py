"""The app on a Ray cluster: engine replicas (one engine with its sessions each, reserving the
CPUs it computes on) behind one ingress that serves the web page and the OpenAI API.

    specchat serve --ray                       # a Ray instance on this machine
    specchat serve --ray 10.0.0.5:6379 --replicas 4
    specchat serve --ray auto --min-replicas 1 --max-replicas 4 --target-ongoing-requests 4

The ingress is one process: the page's per-browser state lives there. The replicas are as many as
``--replicas`` (or autoscaled on their ongoing requests); each prepares or finds the models in
its own node's cache (:mod:`engine.startup`), answers Ray's health checks with the engine's
health, and keeps its conversations' KV caches, which the affinity router
(:mod:`engine.cluster.router`) sends their turns back to. Settings come from the flags, else
from ``--cluster-config FILE`` (TOML, a ``[cluster]`` table with the same names), else defaults.
"""

from __future__ import annotations

import argparse
import logging
import math
import signal
import sys
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from engine.cli import is_loopback
from engine.cluster import APP_NAME, ENGINE
from engine.errors import EngineError
from engine.interface import EngineClient

ROOT = Path(__file__).resolve().parents[2]  # where `engine` and `app` are imported from on every node
LOCAL = "local"  # --ray without an address: start a Ray instance in this process
MIN_THREADS = 2
ROUTER = "engine.cluster.router.AffinityRouter"
# HTTP requests the ingress holds at once: each open page holds a few long ones (Gradio's event
# streams), so Ray's default of 5 would stall the second visitor.
INGRESS_REQUESTS = 1000
# Seconds a replica being removed (scaled down, redeployed) has to finish its answers.
DRAIN_S = 300


@dataclass
class ClusterSettings:
    replicas: int = 2
    min_replicas: int | None = None  # with max_replicas: autoscaled instead of a fixed count
    max_replicas: int | None = None
    target_ongoing_requests: float = 4.0
    cpus_per_replica: float = 1.0

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ClusterSettings:
        """The flags given, over the config file's values, over the defaults."""
        values: dict[str, Any] = {}
        if args.cluster_config:
            try:
                values = tomllib.loads(Path(args.cluster_config).read_text()).get("cluster", {})
            except (OSError, tomllib.TOMLDecodeError) as exc:
                raise EngineError(f"cannot read the cluster config {args.cluster_config}: {exc}") from exc
        names = {f.name for f in fields(cls)}
        if unknown := set(values) - names:
            raise EngineError(f"unknown setting(s) in {args.cluster_config}: {', '.join(sorted(unknown))}")
        values |= {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}
        settings = cls(**values)
        settings.check()
        return settings

    def check(self) -> None:
        autoscaled = (self.min_replicas, self.max_replicas)
        if (None in autoscaled) != (autoscaled == (None, None)):
            raise EngineError("autoscaling needs both --min-replicas and --max-replicas")
        if self.replicas < 1 or self.cpus_per_replica <= 0 or self.target_ongoing_requests <= 0:
            raise EngineError("replicas, CPUs per replica and the target load must be positive")
        if self.autoscaled and not 1 <= self.min_replicas <= self.max_replicas:  # type: ignore[operator]
            raise EngineError("--min-replicas must be between 1 and --max-replicas (the page needs a replica)")

    @property
    def autoscaled(self) -> bool:
        return self.max_replicas is not None

    @property
    def threads(self) -> int:
        """The CPU threads each replica's models compute on: the CPUs it reserves, but never one
        (OpenVINO's CPU plugin dies of a division by zero on a single thread or core:
        openvinotoolkit/openvino#33300, seen here with 2026.4)."""
        return max(MIN_THREADS, math.floor(self.cpus_per_replica))

    def scaling(self) -> dict[str, Any]:
        """The deployment options that size the replica set."""
        if not self.autoscaled:
            return {"num_replicas": self.replicas}
        return {
            "autoscaling_config": {
                "min_replicas": self.min_replicas,
                "max_replicas": self.max_replicas,
                "target_ongoing_requests": self.target_ongoing_requests,
            }
        }


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("cluster (Ray Serve; docs/operations.md)")
    group.add_argument(
        "--ray",
        nargs="?",
        const=LOCAL,
        metavar="ADDRESS",
        help="serve engine replicas on a Ray cluster (ADDRESS: a head's host:port, or 'auto'; none: a Ray "
        "instance on this machine)",
    )
    group.add_argument("--replicas", type=int, help="engine replicas (default 2)")
    group.add_argument("--min-replicas", type=int, help="autoscale between this and --max-replicas")
    group.add_argument("--max-replicas", type=int)
    group.add_argument("--target-ongoing-requests", type=float, help="autoscaling's target per replica (default 4)")
    group.add_argument("--cpus-per-replica", type=float, help="CPUs each replica reserves and computes on (default 1)")
    group.add_argument("--cluster-config", metavar="FILE", help="a TOML file with a [cluster] table of these settings")


def application(args: argparse.Namespace, settings: ClusterSettings, web: Callable[[EngineClient], Any]) -> Any:
    """The Serve application: the ingress (``web(engine)`` builds its ASGI app) over the replicas."""
    from ray import serve

    from engine.cluster.ingress import Ingress
    from engine.cluster.replica import MAX_CALLS, EngineReplica

    replicas = serve.deployment(
        name=ENGINE,
        ray_actor_options={"num_cpus": settings.cpus_per_replica},
        max_ongoing_requests=MAX_CALLS,
        health_check_period_s=5,
        health_check_timeout_s=30,
        graceful_shutdown_timeout_s=DRAIN_S,
        request_router_config={"request_router_class": ROUTER},
        **settings.scaling(),
    )(EngineReplica)
    ingress = serve.deployment(
        name="ingress", num_replicas=1, max_ongoing_requests=INGRESS_REQUESTS, ray_actor_options={"num_cpus": 0}
    )(Ingress)
    return ingress.bind(replicas.bind(args, settings.threads), web)


def connect(address: str | None) -> None:
    """Join the Ray cluster at ``address`` (None: start one here), with this checkout importable
    in every worker (the same path on every node: see docs/operations.md). A cluster on loopback
    is joined on loopback too (Ray would otherwise name this machine by its network address)."""
    import ray

    on_loopback = address not in (None, LOCAL, "auto") and is_loopback(str(address).rpartition(":")[0])
    ray.init(
        address=None if address in (None, LOCAL) else address,
        _node_ip_address="127.0.0.1" if on_loopback else None,
        runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}},
        logging_level=logging.WARNING,
        log_to_driver=True,
    )


def deploy(args: argparse.Namespace, web: Callable[[EngineClient], Any]) -> str:
    """Deploy the app on the cluster ``args.ray`` names, serving HTTP on ``args.host:args.port``
    (on the head node); return its URL once the ingress answers."""
    from ray import serve

    settings = ClusterSettings.from_args(args)
    connect(args.ray)
    serve.start(http_options={"host": args.host, "port": args.port}, proxy_location="HeadOnly")
    quiet = {"enable_access_log": False}  # (the page polls: a line per request would bury the rest)
    try:
        serve.run(application(args, settings, web), name=APP_NAME, route_prefix="/", logging_config=quiet)
    except RuntimeError as exc:  # a replica that cannot start (a model that cannot be prepared...)
        reason = str(exc).strip().splitlines()[0]
        raise EngineError(f"the app could not be deployed on the cluster: {reason} (the log above has why)") from exc
    return f"http://{'localhost' if args.host in ('0.0.0.0', '::') else args.host}:{args.port}/"


def serve_forever(args: argparse.Namespace, web: Callable[[EngineClient], Any]) -> int:
    """``specchat serve --ray``: deploy, say where, serve until interrupted, then take the
    application down, and Serve with it if it serves nothing else (the cluster stays)."""
    from ray import serve

    url = deploy(args, web)
    print(f"serving at {url} (engine replicas on Ray)", flush=True)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stopped by a service manager: the same
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("taking the application down", file=sys.stderr)
        serve.delete(APP_NAME)
        if not serve.status().applications:  # (Serve keeps its port until it is shut down)
            serve.shutdown()
    return 0

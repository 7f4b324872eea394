"""A Ray cluster of two nodes on this machine, on loopback: a head and a second node started with
``ray start`` exactly as on two machines, for tests and measurements. Each node offers
``cpus`` CPUs, so that with one CPU per replica each replica runs on a node of its own.

Its own temporary folder and ports; it leaves nothing running: ``ray stop`` at the end stops
every Ray process of this user on this machine, so do not run it beside a cluster of your own."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

from engine.cli import free_port
from engine.cluster import APP_NAME, ENGINE
from engine.cluster.deploy import ROOT, connect

LOOPBACK = "127.0.0.1"
RAY = str(Path(sys.executable).with_name("ray"))
# A throwaway cluster on loopback runs without Ray's token authentication: Ray 2.60 turns it on
# for any process that finds a token in ~/.ray/auth_token, and a node or driver started without
# it is then refused. Every process of the cluster (nodes, the app, drivers) must agree.
NO_AUTH = {"RAY_AUTH_MODE": "disabled"}


def ray(*args: str, timeout: float = 180) -> None:
    """Run ``ray ARGS`` with this checkout importable by the node's workers; a failure says why."""
    env = os.environ | {"PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0"} | NO_AUTH
    done = subprocess.run([RAY, *args], env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        raise RuntimeError(f"ray {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")


def node_flags(cpus: float) -> list[str]:
    """What both nodes are started with: loopback, no dashboard, no ports shared between them."""
    return [
        f"--node-ip-address={LOOPBACK}",
        f"--num-cpus={cpus:g}",
        f"--dashboard-agent-listen-port={free_port()}",
        f"--metrics-export-port={free_port()}",
        "--disable-usage-stats",
    ]


@contextlib.contextmanager
def two_nodes(cpus: float = 1) -> Iterator[str]:
    """Start a head and a second node on this machine; yield the head's address; stop both."""
    port = free_port()
    address = f"{LOOPBACK}:{port}"
    with tempfile.TemporaryDirectory(prefix="ray-") as temp, mock.patch.dict(os.environ, NO_AUTH):
        try:
            head = ["--head", f"--port={port}", f"--temp-dir={temp}", "--include-dashboard=false"]
            ray("start", *head, *node_flags(cpus))
            ray("start", f"--address={address}", *node_flags(cpus))
            yield address
        finally:
            with contextlib.suppress(Exception):
                ray("stop", "--force", timeout=60)


def replicas(app: str = APP_NAME, deployment: str = ENGINE) -> list[str]:
    """The ids of the deployment's live replicas (this process must be connected to the cluster)."""
    import ray

    prefix = f"SERVE_REPLICA::{app}#{deployment}#"
    named = ray.util.list_named_actors(all_namespaces=True)
    return sorted(a["name"].removeprefix(prefix) for a in named if a["name"].startswith(prefix))


def kill_replica(replica: str, app: str = APP_NAME, deployment: str = ENGINE) -> None:
    """Kill a replica's process outright, as a crash would (Ray Serve then starts another)."""
    import ray

    actor = ray.get_actor(f"SERVE_REPLICA::{app}#{deployment}#{replica}", namespace="serve")
    ray.kill(actor, no_restart=True)


@contextlib.contextmanager
def connected(address: str) -> Iterator[None]:
    """This process joined to the cluster at ``address`` (to look at or kill replicas), then not."""
    import ray

    connect(address)
    try:
        yield
    finally:
        ray.shutdown()

"""The app on a Ray cluster of two nodes on this machine (loopback only), measured by the load
benchmark, with one engine replica killed in the middle of the many-users phase.

    python -m benchmarks.scaleout                        # default pair: 1 then 2 replicas, 8 users x 5 turns
    python -m benchmarks.scaleout --replicas 2 --kill-after 0    # no replica killed

For each replica count: ``ray start`` a head and a second node (one CPU each, so that each
replica has a node of its own), ``specchat serve --ray`` the app on them, run
:mod:`benchmarks.loadtest` through the app's page API (the lone user's phase first: the solo
runs every answer is checked against), kill one replica ``--kill-after`` seconds into the
many-users phase, then stop everything. Arguments it does not know go to the app (the models).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from benchmarks import loadtest
from benchmarks.chaos import app_server
from benchmarks.report import add_output_arguments, write_text
from engine.cli import CODING_PROMPTS, run_cli
from engine.cluster import local
from engine.errors import EngineError
from engine.report import Column, markdown_table

SHARED = {c.key: c for c in loadtest.COLUMNS + loadtest.CLUSTER_COLUMNS}  # the load benchmark's own
COLUMNS = [
    Column("replicas", "deployed"),
    *(SHARED[key] for key in ("users", "answers", "aggregate_tokens_per_s")),
    Column("per replica tokens/s", "replica_tokens_per_s"),
    *(SHARED[key] for key in ("user_tokens_per_s_p50", "ttft_p50_s", "ttft_p95_s", "affinity", "killed", "errors")),
    SHARED["differ"],
]


def killer(seconds: float, users: int, record: dict, timers: list[threading.Timer]) -> Callable[[int], None]:
    """What starts as the phase of ``users`` starts: one replica killed ``seconds`` later (and
    written into ``record``; the timer into ``timers``, to be cancelled if the phase ends first)."""

    def kill() -> None:
        live = local.replicas()
        if live:
            local.kill_replica(live[0])
            record.update(killed_replica=live[0], killed_at_s=seconds)
            print(f"killed replica {live[0]} {seconds:g} s into the {users}-user phase", flush=True)

    def on_phase(phase_users: int) -> None:
        if seconds > 0 and phase_users == users:
            timers.append(threading.Timer(seconds, kill))
            timers[-1].start()

    return on_phase


def wait_for_replicas(url: str, count: int, timeout_s: float = 900) -> None:
    """Wait until the app's /health says ``count`` engine replicas run."""
    deadline = time.monotonic() + timeout_s
    while httpx.get(f"{url}health", timeout=10).json().get("replicas", 0) < count:
        if time.monotonic() > deadline:
            raise EngineError(f"{count} replicas were not running within {timeout_s:g} s")
        time.sleep(2)


def measure(address: str, deployed: int, args: argparse.Namespace, app_args: list[str]) -> list[dict]:
    """The load benchmark's rows against the app with ``deployed`` replicas on the cluster."""
    record: dict = {}
    serve = [*app_args, "--ray", address, "--replicas", str(deployed), "--cpus-per-replica", "1"]
    with app_server(serve) as (url, _), tempfile.TemporaryDirectory() as out, local.connected(address):
        argv = ["--url", url, "--users", "1", str(args.users), "--turns", str(args.turns)]
        argv += ["--prompts", str(args.prompts), "--max-new-tokens", str(args.max_new_tokens)]
        argv += ["--json", f"{out}/load.json", "--table", f"{out}/load.md", "--chart", f"{out}/load.png"]
        wait_for_replicas(url, deployed)  # (the app answers as soon as one replica is up)
        kill_after = args.kill_after if deployed > 1 else 0  # (killing the only replica is an outage)
        timers: list[threading.Timer] = []
        try:
            loadtest.main(argv, on_phase=killer(kill_after, args.users, record, timers))
        finally:
            for timer in timers:
                timer.cancel()
        rows = json.loads(Path(f"{out}/load.json").read_text())["rows"]
    for row in rows:
        per_replica = row["per_replica"].values()
        row |= {"deployed": deployed, **record} if row["users"] == args.users else {"deployed": deployed}
        row["replica_tokens_per_s"] = " / ".join(f"{r['tokens_per_s']:.1f}" for r in per_replica) or None
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scaleout", description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2], help="replica counts to measure")
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--prompts", type=Path, default=CODING_PROMPTS)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--kill-after", type=float, default=60, help="seconds into the many-users phase; 0: no kill")
    add_output_arguments(parser, json=Path("bench-results/scaleout.json"), table=Path("bench-results/scaleout.md"))
    args, app_args = parser.parse_known_args(argv)

    def scaleout() -> None:
        rows: list[dict] = []
        started = time.strftime("%Y-%m-%d %H:%M")
        for deployed in args.replicas:
            with local.two_nodes(cpus=1) as address:
                rows += measure(address, deployed, args, app_args)
            print(markdown_table(rows, COLUMNS), flush=True)
        table = markdown_table(rows, COLUMNS)
        print(table)
        write_text(args.table, table + "\n")
        record = {"started": started, "settings": vars(args) | {"app_args": app_args}, "rows": rows}
        write_text(args.json, json.dumps(record, indent=1, default=str))
        if any(r["errors"] or r["lost"] or r["mixed"] for r in rows):
            raise EngineError("some answers were lost, mixed or failed other than by the kill (listed above)")

    return run_cli(scaleout)


if __name__ == "__main__":
    sys.exit(main())

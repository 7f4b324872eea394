"""SpecChat: a chat web app over the speculative-decoding engine.

``python app.py [--target SPEC] [--draft SPEC] [--host H] [--port N] [--share] [--auth USER:PASS]``,
or ``specchat serve ...`` once installed (``pip install .``; ``specchat --help`` lists the commands).

This file only launches: it reads the flags, starts the engine behind a placeholder that answers
while the models are prepared, and serves the page (:mod:`ui`) with the OpenAI-compatible API
(:mod:`engine.api`) on one port, or deploys both over engine replicas on a Ray cluster.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from functools import partial

from engine.cli import run_cli
from engine.cluster import deploy as cluster
from engine.core.modes import MODES
from engine.loading import Loading
from engine.prepare.pipeline import add_model_arguments, cache_dir_from_args
from engine.startup import add_engine_arguments, start_engine
from ui.options import (
    add_serving_arguments,
    browser_secret,
    client_limits,
    launch_warnings,
    model_sources,
    parse_auth,
    public,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Chat with an LLM on CPU, sped up by speculative decoding (OpenVINO).")
    add_model_arguments(parser)
    add_engine_arguments(parser)
    add_serving_arguments(parser)
    cluster.add_cluster_arguments(parser)
    args = parser.parse_args(argv)
    args.client_limits = client_limits(args)
    args.shared_pool = args.shared_pool or not public(args)  # (a private server's clients are one person)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        auth = parse_auth(args.auth)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for warning in launch_warnings(args.host, args.share, auth, bool(args.api_key)):
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    if args.ray is not None:  # (the ingress builds the page: ui.launch.web_app, importable on every node)
        from ui.launch import web_app

        return run_cli(lambda: cluster.serve_forever(args, partial(web_app, args)))
    engine = Loading(lambda: start_engine(args), tuple(MODES))  # the server listens meanwhile
    # Imported once the models load in their thread (OpenVINO's work, without the GIL): Gradio's
    # import is seconds of a restart on a small CPU (docs/operations.md, "Resources").
    from engine.api.openai import build_router
    from ui.launch import launch
    from ui.page import build_app

    api = build_router(engine, args.target, model_sources(args), args.api_key, args.trust_proxy)
    try:
        secret = browser_secret(cache_dir_from_args(args))
        demo = build_app(engine, secret=secret, limits=args.client_limits, overflow=args.context_overflow)
        launch(demo, args.host, args.port, args.share, auth, api=api)
    except OSError as exc:
        print(f"error: cannot serve on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    return 0


# `specchat COMMAND`: the app, and the model preparation as `python -m engine.prepare` runs it.
COMMANDS = {
    "serve": ("app", "the chat app, its OpenAI-compatible API and /health on one port (--ray: on a cluster)"),
    "prepare": ("engine.prepare.cli", "fetch and convert the models (the first start does it too)"),
}


def cli(argv: list[str] | None = None) -> int:
    """The installed ``specchat`` command: ``specchat COMMAND [ARGS]``, ARGS as the command's own ``--help``."""
    parser = argparse.ArgumentParser(
        prog="specchat",
        description="An LLM chat on CPU, sped up by speculative decoding (OpenVINO).",
        epilog="commands:\n"
        + "\n".join(f"  {name:<13} {what}" for name, (_, what) in COMMANDS.items())
        + "\n\nThe benchmarks run from a checkout: python -m benchmarks.bench --help (README).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("command", choices=COMMANDS, metavar="COMMAND")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the command's own arguments")
    args = parser.parse_args(argv)
    module = importlib.import_module(COMMANDS[args.command][0])
    sys.argv[0] = f"specchat {args.command}"  # the command's usage line names it so
    return module.main(args.args)


if __name__ == "__main__":
    sys.exit(main())

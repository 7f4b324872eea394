"""The serving flags and what they decide: where the app listens, whom it lets in, the limits
per client, the login and the key conversations are sealed with, and what an operator is warned
about before strangers can reach the app. No Gradio here: ``app.py`` reads the flags and starts
loading the models while Gradio imports (:mod:`ui.launch`), seconds of a restart on a small CPU."""

from __future__ import annotations

import argparse
import logging
import os
import secrets
from pathlib import Path

from engine.cli import is_loopback
from engine.core.turns import NO_LIMITS, PUBLIC_LIMITS, ClientLimits

AUTH_ENV = "SPECCHAT_AUTH"
SECRET_ENV = "SPECCHAT_BROWSER_SECRET"
API_KEY_ENV = "SPECCHAT_API_KEY"


def add_serving_arguments(parser: argparse.ArgumentParser) -> None:
    """Where the app serves and whom it lets in: address, port, share link, login, API key, and
    the limits per client."""
    parser.add_argument(
        "--host",
        default=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"),
        help="address to listen on (0.0.0.0: every interface; default: $GRADIO_SERVER_NAME or loopback)",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=int(os.environ.get("GRADIO_SERVER_PORT", "7860")),
        help="default: $GRADIO_SERVER_PORT or 7860",
    )
    parser.add_argument("--share", action="store_true", help="also ask Gradio for a public link")
    parser.add_argument(
        "--auth", metavar="USER:PASS", default=os.environ.get(AUTH_ENV), help=f"require a login (default: ${AUTH_ENV})"
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"the key /v1 needs as 'Authorization: Bearer KEY' (default: ${API_KEY_ENV})",
    )
    parser.add_argument(
        "--public-limits",
        action="store_true",
        default=bool(os.environ.get("SPECCHAT_PUBLIC_LIMITS")),
        help=f"a shared link's limits, stated on the page: {PUBLIC_LIMITS.describe()} (on by itself with --share "
        "or a public --host; default: $SPECCHAT_PUBLIC_LIMITS)",
    )
    parser.add_argument(
        "--shared-pool",
        action="store_true",
        default=bool(os.environ.get("SPECCHAT_SHARED_POOL")),
        help="draft every client's answers from one n-gram pool of all earlier answers, not one pool per client: "
        "faster where users trust each other, but an answer's speed may hint at what others wrote (on by itself "
        "where --public-limits is off; default: $SPECCHAT_SHARED_POOL)",
    )
    parser.add_argument(
        "--trust-proxy", action="store_true", help="name API callers by X-Forwarded-For (only behind your own proxy)"
    )


def public(args: argparse.Namespace) -> bool:
    """Whether strangers can reach the app (or the operator says to treat it so)."""
    return args.public_limits or args.share or not is_loopback(args.host)


def client_limits(args: argparse.Namespace) -> ClientLimits:
    """The per-client limits the flags ask for: on by themselves where strangers can reach the app."""
    return PUBLIC_LIMITS if public(args) else NO_LIMITS


def model_sources(args: argparse.Namespace) -> dict[str, dict[str, str]]:
    """Each role's source and precision as given, for /health."""
    return {
        role: {"source": getattr(args, role), "precision": getattr(args, f"{role}_precision")}
        for role in ("target", "draft")
    }


def launch_warnings(host: str, share: bool, auth: tuple[str, str] | None, keyed: bool = False) -> list[str]:
    """What an operator should hear before strangers can reach the app or its API without a login."""
    if is_loopback(host) and not share:
        return []
    reach = "a public share link" if share else f"the address {host}"
    said = [] if auth else [f"{reach} serves the app without a login: pass --auth USER:PASS (or ${AUTH_ENV})"]
    if not keyed and not is_loopback(host):
        said.append(f"the address {host} serves the API (/v1) without a key: pass --api-key KEY (or ${API_KEY_ENV})")
    return said


def parse_auth(text: str | None) -> tuple[str, str] | None:
    if not text:
        return None
    user, sep, password = text.partition(":")
    if not (sep and user and password):
        raise ValueError(f"--auth / ${AUTH_ENV} must look like USER:PASS")
    return user, password


def browser_secret(folder: Path) -> str | None:
    """The key the conversations kept in browsers are sealed with (against tampering, not prying:
    the page holds it), kept in the cache folder so that they open again after a restart
    (``$SPECCHAT_BROWSER_SECRET`` overrides it; None, a key for this run only, where the folder
    cannot be written)."""
    if os.environ.get(SECRET_ENV):
        return os.environ[SECRET_ENV]
    path = folder / "browser-secret"
    try:
        if not path.exists():
            folder.mkdir(parents=True, exist_ok=True)
            path.touch(mode=0o600)
            path.write_text(secrets.token_urlsafe(24))
        return path.read_text().strip() or None
    except OSError as exc:
        logging.getLogger("specchat").warning(f"conversations kept in browsers will not survive a restart: {exc}")
        return None

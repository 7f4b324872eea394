"""Serving the page: alone (with the API's routes on the same port) or mounted in an ASGI app
(the cluster's ingress), as the flags of :mod:`ui.options` say."""

from __future__ import annotations

import argparse
import contextlib
import io
from typing import Any

import gradio as gr
from fastapi import APIRouter, FastAPI

from engine.api.openai import build_router
from engine.cli import ASSETS
from engine.interface import EngineClient
from engine.prepare.pipeline import cache_dir_from_args
from engine.render import markdown
from ui.options import browser_secret, model_sources, parse_auth
from ui.page import build_app

THEME = gr.themes.Soft(primary_hue="indigo", secondary_hue="emerald", neutral_hue="slate")


def launch(
    demo: gr.Blocks,
    host: str = "127.0.0.1",
    port: int | None = None,
    share: bool = False,
    auth: tuple[str, str] | None = None,
    block: bool = True,
    api: APIRouter | None = None,
) -> str:
    """Serve ``demo`` (and ``api``'s routes on the same port) and return its local URL. Where no
    share link can be made (no internet, no tunnel client), say so in one line and keep serving
    locally."""
    gradio_says = io.StringIO()
    with contextlib.redirect_stdout(gradio_says) if share else contextlib.nullcontext():
        demo.launch(
            server_name=host,
            server_port=port,
            share=share,
            auth=auth,
            prevent_thread_lock=True,
            quiet=True,
            **page_options(),
        )
    if api is not None:
        demo.server_app.include_router(api)
    local = str(demo.local_url)
    if share and demo.share_url:
        print(f"serving at {local} and at the public link {demo.share_url}", flush=True)
    elif share:
        said = next((line.strip() for line in gradio_says.getvalue().splitlines() if line.strip()), "")
        reason = said.removeprefix("Could not create share link.").strip().rstrip(".") or "no tunnel"
        print(
            f"share link unavailable: Gradio could not open its tunnel ({reason}; it needs internet access); "
            f"serving locally at {local}",
            flush=True,
        )
    else:
        print(f"serving at {local}", flush=True)
    if block:
        demo.block_thread()
    return local


def page_options() -> dict[str, Any]:
    """How the page is served, alone or mounted in the cluster's ingress."""
    return {
        "show_error": False,  # users see the handlers' own messages; tracebacks go to the log
        "max_file_size": "1mb",  # (the only uploads: conversations to import)
        "theme": THEME,
        "css_paths": [ASSETS / "style.css"],
        "css": markdown.highlight_css(),
        "footer_links": ["api", "settings"],
    }


def web_app(args: argparse.Namespace, engine: EngineClient) -> FastAPI:
    """The page and the API on ``engine`` as one ASGI app: what the cluster's ingress serves."""
    server = FastAPI()
    server.include_router(build_router(engine, args.target, model_sources(args), args.api_key, args.trust_proxy))
    secret = browser_secret(cache_dir_from_args(args))
    demo = build_app(engine, secret=secret, limits=args.client_limits, overflow=args.context_overflow)
    return gr.mount_gradio_app(server, demo, path="/", auth=parse_auth(args.auth), **page_options())

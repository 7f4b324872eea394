"""Prepare the models a command line names and load them into an engine: what the app does at
start, and what each replica of a cluster does on its own node."""

from __future__ import annotations

import argparse
import logging

from engine.core.runtime import DRAFT_CONFIG, TARGET_CONFIG
from engine.core.service import Engine
from engine.core.turns import NO_LIMITS
from engine.prepare.pipeline import prepare_from_args


def start_engine(args: argparse.Namespace, threads: int | None = None) -> Engine:
    """Prepare the models (converting them on first use; a lock per cache entry keeps two
    processes on one machine from converting the same model twice) and load them once.
    ``threads``: the CPU threads each model may use (default: the plugin's, every core)."""
    target, draft = prepare_from_args(args)
    logging.getLogger("specchat.prepare").info(f"loading and warming up the models on {args.device}")
    limit = {} if threads is None else {"INFERENCE_NUM_THREADS": threads}
    return Engine(
        target.path,
        draft.path,
        device=args.device,
        config=TARGET_CONFIG | limit,
        draft_config=DRAFT_CONFIG | limit,
        max_input_tokens=args.max_input_tokens,
        max_sessions=args.max_sessions,
        memory_limit=getattr(args, "memory_limit", None),
        client_limits=getattr(args, "client_limits", None) or NO_LIMITS,
        shared_pool=getattr(args, "shared_pool", False),
    )

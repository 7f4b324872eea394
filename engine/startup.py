"""Prepare the models a command line names and load them into an engine: what the app does at
start, and what each replica of a cluster does on its own node."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import Any

from engine.core.budget import parse_size
from engine.core.reader import READERS
from engine.core.runtime import DRAFT_CONFIG, TARGET_CONFIG
from engine.core.service import Engine
from engine.core.settings import BATCHING, KERNELS, Settings
from engine.core.turns import NO_LIMITS
from engine.core.window import Overflow
from engine.ggml import ACTIVATIONS
from engine.prepare import ggml_ir, phases
from engine.prepare.pipeline import PreparedModel, cache_dir_from_args, prepare_from_args


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """What :func:`start_engine` takes besides the models: the device, the input cap and what
    becomes of a longer conversation, the conversations kept and the memory budget."""
    parser.add_argument("--device", default="CPU", help="OpenVINO device for both models")
    parser.add_argument(
        "--max-input-tokens",
        type=int,
        default=None,
        help="the longest conversation accepted, in tokens (default: 3/4 of the context, within --memory-limit)",
    )
    parser.add_argument(
        "--context-overflow",
        choices=tuple(Overflow),
        default=os.environ.get("SPECCHAT_CONTEXT_OVERFLOW", Overflow.WINDOW),
        help="a conversation longer than the input cap: window leaves its oldest turns out of the model's view "
        "(the system prompt stays), stop refuses it; a request may choose for itself "
        "(default: $SPECCHAT_CONTEXT_OVERFLOW, else window)",
    )
    parser.add_argument(
        "--max-sessions",
        type=int,
        default=int(os.environ["SPECCHAT_MAX_SESSIONS"]) if os.environ.get("SPECCHAT_MAX_SESSIONS") else None,
        help="conversations whose KV caches are kept, so their next turn prefills only what is new "
        "(default: $SPECCHAT_MAX_SESSIONS, else 32, their caches within --memory-limit)",
    )
    parser.add_argument(
        "--memory-limit",
        type=parse_size,
        default=parse_size(os.environ["SPECCHAT_MEMORY_LIMIT"]) if os.environ.get("SPECCHAT_MEMORY_LIMIT") else None,
        metavar="SIZE",
        help="memory the server may use, e.g. 8G: KV caches and prompt lengths are admitted within it "
        "(default: $SPECCHAT_MEMORY_LIMIT, else 30%% of the machine's memory)",
    )
    parser.add_argument(
        "--prompt-reader",
        choices=READERS,
        default="auto",
        help="how prompts are read: a stateless copy of the target in large passes, in f32 or bf16 on the "
        "plugin's kernels; gemm, the target's own passes with ggml's batched kernels (on ggml's kernels); or off (the "
        "target's own passes); auto times each the memory budget holds and uses the fastest where it reads faster",
    )
    parser.add_argument(
        "--kernels",
        choices=KERNELS,
        default=os.environ.get("SPECCHAT_KERNELS", "auto"),
        help="what computes the linear layers: the OpenVINO plugin's kernels, or ggml's on the GGUF's own blocks "
        "(built for this CPU on first use, a few minutes); auto times both at start, per model, and keeps the "
        "faster (default: $SPECCHAT_KERNELS, else auto)",
    )
    parser.add_argument(
        "--activations",
        type=int,
        choices=ACTIVATIONS,
        default=int(os.environ["SPECCHAT_ACTIVATIONS"]) if os.environ.get("SPECCHAT_ACTIVATIONS") else None,
        help="bits per activation ggml's kernels multiply the GGUF's Q4_K and Q6_K blocks by: 8 as llama.cpp does, "
        "or 14 in the blocks whose largest value stands out (CPUs with AVX-512 VNNI): the file's model to a finer "
        "rounding, a few percent slower (default: $SPECCHAT_ACTIVATIONS, else 8)",
    )
    parser.add_argument(
        "--remeasure",
        action="store_true",
        help="time the kernels, the prompt reader and the passes again at start, even where this machine kept "
        "them from an earlier start (they are kept per CPU, kernels' build, models and settings)",
    )
    parser.add_argument(
        "--batching",
        choices=BATCHING,
        default="auto",
        help="whether requests that generate at once share batched passes (off: each its own rounds, every "
        "answer its solo run's bit for bit; auto: on where a batched row computes its lone logits here)",
    )
    parser.add_argument(
        "--batch-speculation",
        choices=("on", "off"),
        default="on",
        help="whether requests served together verify their lookup and pool copies in the batched pass "
        "(off: plain batched steps while more than one request generates)",
    )


def start_engine(args: argparse.Namespace, threads: int | None = None) -> Engine:
    """Prepare the models (converting them on first use; a lock per cache entry keeps two
    processes on one machine from converting the same model twice) and load them once.
    ``threads``: the CPU threads each model may use (default: the plugin's, every core)."""
    with ggml_ir.built_meanwhile(
        (args.target, args.draft) if getattr(args, "kernels", "auto") != "openvino" else (), cache_dir_from_args(args)
    ):
        target, draft = prepare_from_args(args)
    library = kernels_library(args, (target, draft))
    logging.getLogger("specchat.prepare").info(f"loading and warming up the models on {args.device}")
    limit = {} if threads is None else {"INFERENCE_NUM_THREADS": threads}
    prepared_here = phases.summary() is not None
    with phases.phase("loading and measuring"):
        engine = _engine(args, target, draft, library, limit)
    if prepared_here:  # (a first start: say where its time went)
        logging.getLogger("specchat.prepare").info(f"first start, time spent: {phases.summary()}")
    return engine


def _engine(
    args: argparse.Namespace, target: PreparedModel, draft: PreparedModel, library: Path | None, limit: dict
) -> Engine:
    return Engine(
        target.path,
        draft.path,
        Settings(
            device=args.device,
            config=TARGET_CONFIG | limit,
            draft_config=DRAFT_CONFIG | limit,
            max_input_tokens=args.max_input_tokens,
            context_overflow=getattr(args, "context_overflow", Overflow.WINDOW),
            max_sessions=args.max_sessions,
            memory_limit=getattr(args, "memory_limit", None),
            client_limits=getattr(args, "client_limits", None) or NO_LIMITS,
            shared_pool=getattr(args, "shared_pool", False),
            prompt_reader=getattr(args, "prompt_reader", "auto"),
            batching=getattr(args, "batching", "auto"),
            batch_speculation=getattr(args, "batch_speculation", "on") == "on",
            kernels=getattr(args, "kernels", "auto"),
            library=library,
            activations=getattr(args, "activations", None),
            remeasure=getattr(args, "remeasure", False),
        ),
    )


def kernels_library(args: argparse.Namespace, models: tuple[PreparedModel, ...]) -> Path | None:
    """The GgmlLinear op's library for ``args.kernels``, each model from a GGUF given its graph
    on it (None: the plugin's kernels only)."""
    choice = getattr(args, "kernels", "auto")
    if choice == "openvino":
        return None
    return ggml_ir.for_models(models, cache_dir_from_args(args), required=choice == "ggml")


def engine_from_args(args: argparse.Namespace, target: PreparedModel, draft: PreparedModel, **settings: Any) -> Engine:
    """An engine on prepared models with the command line's memory limit, prompt reader and
    kernels (``settings``: more :class:`~engine.core.settings.Settings`), as the benchmarks load it."""
    return Engine(
        target.path,
        draft.path,
        Settings(
            memory_limit=args.memory_limit,
            prompt_reader=args.prompt_reader,
            kernels=args.kernels,
            library=kernels_library(args, (target, draft)),
            activations=args.activations,
            remeasure=getattr(args, "remeasure", False),
            **settings,
        ),
    )

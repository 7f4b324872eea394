"""``python -m engine.prepare`` (``specchat prepare``): fetch, verify, convert and compress a model
pair (:mod:`engine.prepare.pipeline`), and give each model from a GGUF its graph on ggml's kernels
(:mod:`engine.prepare.ggml_ir`, the op built for this CPU on first use)."""

from __future__ import annotations

import argparse
import json
import sys

from engine.errors import EngineError
from engine.prepare import ggml_ir, phases
from engine.prepare.pipeline import add_model_arguments, cache_dir_from_args, log, prepare_from_args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.prepare", description=__doc__.split("\n\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    try:
        with ggml_ir.built_meanwhile((args.target, args.draft), cache_dir_from_args(args)):
            target, draft = prepare_from_args(args)
        ggml_ir.for_models((target, draft), cache_dir_from_args(args))
        if spent := phases.summary():
            log(f"time spent: {spent}")
    except EngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"target": target.as_dict(), "draft": draft.as_dict()}))
    else:
        print(f"target: {target.path}\ndraft:  {draft.path}")
    return 0

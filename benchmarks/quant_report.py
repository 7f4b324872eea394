"""``python -m benchmarks.quant_report``: what int4 and int8 weights cost against fp16.

For each model of the pair and each precision, teacher-forced over fixed prompts
followed by the fp16 model's own greedy continuation: top-1 next-token agreement
with fp16, and the mean absolute difference of the log-probability of the
reference next token.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from engine.cli import CODING_PROMPTS, run_cli
from engine.core.runtime import Runtime
from engine.hf import auto_tokenizer
from engine.prepare.pipeline import add_model_arguments, cache_dir_from_args, compression_from_args, prepare_one
from engine.report import Column, markdown_table

CONTINUATION = 48
COLUMNS = [
    Column("model", "model"),
    Column("precision", "precision"),
    Column("weights MB", "size_mb", "{:.0f}"),
    Column("top-1 agreement with fp16", "top1_agreement", "{:.3f}"),
    Column("mean abs log-prob diff", "mean_abs_logprob_diff", "{:.3f}"),
]


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def _sequences(reference: Runtime, tokenizer, prompts: list[str]) -> list[list[int]]:
    """Each prompt plus the reference model's greedy continuation."""
    sequences = []
    for prompt in prompts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        tokens = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        reference.reset()
        for _ in range(CONTINUATION):
            tokens.append(int(reference.sync(tokens)[-1].argmax()))
        sequences.append(tokens)
    return sequences


def compare(reference: Runtime, other: Runtime, sequences: list[list[int]]) -> dict:
    agree, deltas = [], []
    for tokens in sequences:
        rows = len(tokens) - 1
        reference.reset()
        other.reset()
        ref = _log_softmax(reference.forward(tokens[:-1], rows))
        got = _log_softmax(other.forward(tokens[:-1], rows))
        agree.append(ref.argmax(-1) == got.argmax(-1))
        nxt = np.asarray(tokens[1:])
        deltas.append(np.abs(ref[np.arange(rows), nxt] - got[np.arange(rows), nxt]))
    return {
        "top1_agreement": float(np.concatenate(agree).mean()),
        "mean_abs_logprob_diff": float(np.concatenate(deltas).mean()),
    }


def run_report(args: argparse.Namespace) -> list[dict]:

    cache = cache_dir_from_args(args)
    prompts = [json.loads(line)["prompt"] for line in CODING_PROMPTS.read_text().splitlines() if line.strip()]
    rows = []
    for role, spec in (("target", args.target), ("draft", args.draft)):
        irs = {p: prepare_one(spec, compression_from_args(args, role, p), cache).path for p in ("fp16", "int8", "int4")}
        reference = Runtime(irs["fp16"], config={"INFERENCE_PRECISION_HINT": "f32"})
        sequences = _sequences(reference, auto_tokenizer(irs["fp16"]), prompts)
        for precision in ("int8", "int4"):
            other = Runtime(irs[precision], config={"INFERENCE_PRECISION_HINT": "f32"})
            size = (irs[precision] / "openvino_model.bin").stat().st_size
            rows.append(
                {
                    "model": f"{role} ({spec})",
                    "precision": precision,
                    "size_mb": size / 1e6,
                    **compare(reference, other, sequences),
                }
            )
        fp16_mb = (irs["fp16"] / "openvino_model.bin").stat().st_size / 1e6
        rows.append(
            {
                "model": f"{role} ({spec})",
                "precision": "fp16",
                "top1_agreement": 1.0,
                "mean_abs_logprob_diff": 0.0,
                "size_mb": fp16_mb,
            }
        )
    print(markdown_table(rows, COLUMNS))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.quant_report", description=__doc__.split("\n\n")[0])
    add_model_arguments(parser)
    return run_cli(lambda: run_report(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())

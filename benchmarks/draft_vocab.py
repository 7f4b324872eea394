"""Rank the target tokenizer's token ids by how often they occur, for the draft head cut to
frequent tokens (FR-Spec, arXiv 2502.14856; engine/core/draft_vocab.py).

    python -m benchmarks.draft_vocab [--target SPEC] [--out PATH] [--max-mb N] [--answers BENCH_JSON ...]

It counts the tokens of text this machine has: a sample of the Python sources of the packages
installed beside the engine (files in the order of a hash of their path, so the sample is the
same on every run and spread over the packages, none giving more than an eighth of it), the prompt
sets in assets/prompts rendered through the chat template, and the answers a bench run wrote
(``--answers``: its ``--json``). The chat template's control tokens come first whatever their
count, then the others by count (ties by id). It keeps the first ``--keep`` ids with the
vocabulary's fingerprint, and prints the share of token occurrences the first 8k to 48k ids cover
in text it did not count: one source file in ten, and the held-out prompt sets.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import sys
import sysconfig
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.bench import load_prompts
from engine.cli import ASSETS, run_cli
from engine.core.chat import prompt_ids
from engine.core.draft_vocab import RANKING, write_ranking
from engine.hf import auto_tokenizer
from engine.prepare.embedded import DEFAULT_TARGET
from engine.prepare.pipeline import default_cache_dir, default_compressions, prepare_one
from engine.report import Column, markdown_table

# One source file in this many is held out of the counts, to measure coverage on.
HELD_OUT = 10
# No package gives more than this share of the sampled text (transformers' hundreds of models
# would otherwise be much of it).
PACKAGE_SHARE = 1 / 8
# Larger files are mostly generated tables, not code anyone writes.
LARGEST_FILE = 256 * 1024
# Ids kept in the file: past them a cut head saves little (and 4 bytes an id, the file stays small).
KEEP = 65536
# The head sizes whose coverage is printed.
COVERAGE_AT = (8192, 16384, 32768, 49152)
# Files tokenized at once.
BATCH = 64


def python_sources(root: Path, max_bytes: int, held_out: bool) -> list[Path]:
    """Up to ``max_bytes`` of the ``.py`` files under ``root``, in the order of a hash of their path:
    the held-out ones (one in :data:`HELD_OUT`), or the others."""
    chosen: list[Path] = []
    by_package: dict[str, int] = {}
    total = 0
    hashed = sorted((hashlib.sha256(str(f.relative_to(root)).encode()).hexdigest(), f) for f in root.rglob("*.py"))
    for digest, file in hashed:
        if (int(digest[:8], 16) % HELD_OUT == 0) != held_out:
            continue
        size, package = file.stat().st_size, file.relative_to(root).parts[0]
        if size > LARGEST_FILE or by_package.get(package, 0) + size > PACKAGE_SHARE * max_bytes:
            continue
        chosen.append(file)
        by_package[package] = by_package.get(package, 0) + size
        total += size
        if total >= max_bytes:
            break
    return chosen


def count_texts(tokenizer: Any, texts: Iterable[str], size: int) -> np.ndarray:
    """How many times each id occurs in ``texts`` tokenized as plain text."""
    counts, texts = np.zeros(size, dtype=np.int64), list(texts)
    for start in range(0, len(texts), BATCH):
        batch = tokenizer(texts[start : start + BATCH], add_special_tokens=False, verbose=False)
        counts += count_ids(batch["input_ids"], size)
    return counts


def count_ids(sequences: Iterable[Sequence[int]], size: int) -> np.ndarray:
    """How many times each id occurs in ``sequences``."""
    return np.bincount(np.fromiter(itertools.chain.from_iterable(sequences), dtype=np.int64), minlength=size)


def read_sources(files: list[Path]) -> Iterable[str]:
    for file in files:
        try:
            yield file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue


def rendered_prompts(tokenizer: Any, paths: list[Path]) -> list[list[int]]:
    """Each prompt of ``paths`` as the engine would read it: a user's message in the chat template."""
    texts = [text for path in paths for _, text in load_prompts(path)]
    return [prompt_ids(tokenizer, [{"role": "user", "content": text}]) for text in texts]


def answers(paths: list[Path]) -> list[list[int]]:
    """The distinct answers of bench runs (their ``--json``), as token ids."""
    seen: dict[tuple[int, ...], None] = {}
    for path in paths:
        for run in json.loads(path.read_text())["runs"]:
            seen.setdefault(tuple(run["token_ids"]), None)
    return [list(ids) for ids in seen]


def control_ids(tokenizer: Any) -> list[int]:
    """The tokenizer's special tokens (the chat template's <|im_start|> and <|im_end|>, its end of
    text...): kept whatever their count."""
    added = [i for i, token in tokenizer.added_tokens_decoder.items() if token.special]
    return sorted({*added, *tokenizer.all_special_ids})


def rank(counts: np.ndarray, first: list[int]) -> np.ndarray:
    """``first``, then every other id by count (most first, ties by id)."""
    by_count = np.argsort(-counts, kind="stable")
    return np.concatenate([np.asarray(first, dtype=np.int64), by_count[~np.isin(by_count, first)]])


def coverage(ranking: np.ndarray, counts: np.ndarray) -> dict[int, float]:
    """The share of the occurrences in ``counts`` whose id is among the first N of ``ranking``."""
    total = counts.sum()
    return {n: float(counts[ranking[:n]].sum() / total) if total else 0.0 for n in COVERAGE_AT}


def run(args: argparse.Namespace) -> None:
    folder = prepare_one(args.target, default_compressions()["target"], default_cache_dir()).path
    tokenizer = auto_tokenizer(folder)
    size = len(tokenizer)
    root = Path(sysconfig.get_paths()["purelib"])
    counted_files = python_sources(root, int(args.max_mb * 2**20), held_out=False)
    held_files = python_sources(root, int(args.max_mb * 2**20 / HELD_OUT), held_out=True)
    prompt_sets = sorted((ASSETS / "prompts").glob("*.jsonl"))
    held_sets = [p for p in prompt_sets if p.name.startswith("heldout")]
    code = count_texts(tokenizer, read_sources(counted_files), size)
    chats = count_ids(rendered_prompts(tokenizer, [p for p in prompt_sets if p not in held_sets]), size)
    answered = count_ids(answers(args.answers), size)
    counted = code + chats + answered
    ranking = rank(counted, control_ids(tokenizer))[: args.keep]
    write_ranking(args.out, ranking, tokenizer)
    megabytes = sum(f.stat().st_size for f in counted_files) / 2**20
    print(
        f"counted {megabytes:.1f} MB of Python in {len(counted_files)} files "
        f"({code.sum():,} tokens), {len(prompt_sets) - len(held_sets)} prompt sets ({chats.sum():,} tokens), "
        f"{answered.sum():,} answer tokens: {np.count_nonzero(counted):,} distinct ids (the rest ranked by id); "
        f"{len(ranking)} ids kept in {args.out} "
        f"({Path(args.out).stat().st_size / 1024:.0f} KB)\n"
    )
    parts = {"code held out": count_texts(tokenizer, read_sources(held_files), size)}
    if held_sets:
        parts["held-out prompts"] = count_ids(rendered_prompts(tokenizer, held_sets), size)
    parts["counted (all)"] = counted
    rows = []
    for name, counts in parts.items():
        for order, ids in (("by count", ranking), ("by id (a prefix)", np.arange(size))):
            shares = {f"top {n}": share for n, share in coverage(ids, counts).items()}
            rows.append({"text": name, "ids": order, "tokens": int(counts.sum()), **shares})
    columns = [Column("text", "text"), Column("ids", "ids"), Column("tokens", "tokens", "{:,}")]
    columns += [Column(f"top {n // 1024}k", f"top {n}", "{:.4f}") for n in COVERAGE_AT]
    print("Share of token occurrences whose id is among the first N:\n")
    print(markdown_table(rows, columns))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.draft_vocab", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=DEFAULT_TARGET, help="the model whose tokenizer is counted (prepared)")
    parser.add_argument("--out", type=Path, default=RANKING, help="where the ranking is written (.npz)")
    parser.add_argument("--max-mb", type=float, default=30.0, help="Python sources counted, in MB")
    parser.add_argument("--keep", type=int, default=KEEP, help="ids kept in the file, most frequent first")
    parser.add_argument(
        "--answers", type=Path, nargs="*", default=[], help="bench runs' JSON (--json) whose answers are counted too"
    )
    return run_cli(lambda: run(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())

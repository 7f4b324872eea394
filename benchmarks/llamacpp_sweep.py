"""llama.cpp at its best: its speculative configurations for this pair, swept on this machine.

    python -m benchmarks.llamacpp_sweep [--prompts A.jsonl,B.jsonl] [--limit 6] [--json OUT] [--table OUT]

Every configuration of ``llamacpp.SWEEP`` (the draft model at several draft lengths and
confidence floors, each draftless n-gram type, the draft with n-gram types) runs in its own
``llama-server`` on the same GGUF files, all started at once and taking turns per prompt, so
machine drift falls on all of them alike. Greedy, 128 new tokens, the prompts through the
target's chat template as in ``benchmarks.bench``; tokens/s timed from this process, the
speedup over plain llama.cpp in the same run and the acceptance the server reports. The
fastest over the prompt sets (geometric mean of the speedups) is what ``llamacpp.BEST`` names:
the bench's ``llamacpp-best`` mode.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks import llamacpp
from benchmarks.bench import load_prompts
from benchmarks.report import add_output_arguments, write_text
from engine.cli import CODING_PROMPTS, run_cli
from engine.core import chat
from engine.core.tokenizer import load_tokenizer
from engine.prepare.pipeline import add_model_arguments, cache_dir_from_args, prepare_from_args
from engine.report import Column, markdown_table

PROMPT_SETS = (CODING_PROMPTS, CODING_PROMPTS.with_name("general.jsonl"), CODING_PROMPTS.with_name("editing.jsonl"))


@dataclass
class Tally:
    tokens: int = 0
    seconds: float = 0.0
    drafted: int = 0
    accepted: int = 0


def sweep(
    peers: dict[str, llamacpp.LlamaCppPeer], sets: dict[str, list[list[int]]], max_new_tokens: int
) -> dict[str, dict[str, Tally]]:
    """Each prompt through every configuration in turn: tallies per configuration and set."""
    tallies = {name: {s: Tally() for s in sets} for name in peers}
    for set_name, prompts in sets.items():
        for i, prompt_ids in enumerate(prompts):
            for name, peer in peers.items():
                tokens, wall, _ = peer.run(prompt_ids, max_new_tokens, None)
                tally = tallies[name][set_name]
                tally.tokens += len(tokens)
                tally.seconds += wall
                tally.drafted += int(peer.timings.get("draft_n", 0))
                tally.accepted += int(peer.timings.get("draft_n_accepted", 0))
                print(f"  {set_name:>8} {i + 1:>2} {name:<30} {len(tokens) / wall:6.1f} tok/s", file=sys.stderr)
    return tallies


def summarize(tallies: dict[str, dict[str, Tally]]) -> list[dict]:
    """One row per configuration: tokens/s, speedup over plain and acceptance per set, and the
    geometric mean of its speedups (the ranking)."""
    plain = tallies[llamacpp.PLAIN.name]
    rows = []
    for name, per_set in tallies.items():
        flags = " ".join(llamacpp.BY_NAME[name].flags)
        row: dict = {"configuration": name, "flags": f"`{flags}`" if flags else None}
        speedups = []
        for set_name, t in per_set.items():
            base = plain[set_name]
            speedups.append((base.seconds / base.tokens) / (t.seconds / t.tokens))
            row |= {
                f"{set_name}_tokens_per_s": t.tokens / t.seconds,
                f"{set_name}_vs_plain": speedups[-1],
                f"{set_name}_acceptance": t.accepted / t.drafted if t.drafted else None,
            }
        row["mean_vs_plain"] = math.prod(speedups) ** (1 / len(speedups))
        rows.append(row)
    return sorted(rows, key=lambda r: -r["mean_vs_plain"])


def columns(set_names: list[str]) -> list[Column]:
    per_set = [
        column
        for s in set_names
        for column in (
            Column(f"{s} tokens/s", f"{s}_tokens_per_s", "{:.1f}"),
            Column(f"{s} vs plain", f"{s}_vs_plain", "{:.2f}×"),
            Column(f"{s} acceptance", f"{s}_acceptance", "{:.2f}"),
        )
    ]
    return [
        Column("configuration", "configuration"),
        *per_set,
        Column("geometric mean vs plain", "mean_vs_plain", "{:.2f}×"),
        Column("flags", "flags"),
    ]


def run_sweep(args: argparse.Namespace) -> None:
    target, _ = prepare_from_args(args)
    tokenizer = load_tokenizer(target.path)
    sets = {
        Path(path).stem: [
            chat.prompt_ids(tokenizer, [{"role": "user", "content": text}])
            for _, text in load_prompts(Path(path))[: args.limit]
        ]
        for path in args.prompts.split(",")
    }
    cache_dir = cache_dir_from_args(args)
    binary = llamacpp.server_binary(cache_dir)
    model, draft = llamacpp.gguf_file(args.target, cache_dir), llamacpp.gguf_file(args.draft, cache_dir)
    with contextlib.ExitStack() as stack:
        peers = {}
        for spec in llamacpp.SWEEP:
            peers[spec.name] = llamacpp.LlamaCppPeer(binary, model, draft if spec.draft else None, flags=spec.flags)
            stack.callback(peers[spec.name].close)
        rows = summarize(sweep(peers, sets, args.max_new_tokens))
    text = markdown_table(rows, columns(list(sets)))
    print(text)
    print(f"\nfastest: {rows[0]['configuration']} (llamacpp.BEST is {llamacpp.BEST.name})")
    write_text(args.table, text + "\n")
    write_text(args.json, json.dumps({"rows": rows, "max_new_tokens": args.max_new_tokens}, indent=1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.llamacpp_sweep", description=__doc__.split("\n\n")[0])
    add_model_arguments(parser)
    parser.add_argument(
        "--prompts", default=",".join(str(p) for p in PROMPT_SETS), help="prompt files, comma separated"
    )
    parser.add_argument("--limit", type=int, default=6, help="the first N prompts of each file")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    add_output_arguments(parser)
    return run_cli(lambda: run_sweep(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())

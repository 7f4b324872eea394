"""Benchmark: modes compared as ratios in one process, alternating per prompt.

    python -m benchmarks.bench --prompts assets/prompts/coding.jsonl --max-new-tokens 128 \
        --k 3,4,5 --modes ar,sd,genai-ar,genai-sd --json bench-results/coding.json

Modes: ``ar`` (own autoregressive), ``sd`` (own speculative with the draft model),
``adaptive`` (draft model, draft length adapted per round), ``pld`` (prompt lookup),
``hybrid`` (prompt lookup where it matches, else the draft model), ``best`` (the app's
default: the fastest exact configuration), ``genai-ar`` / ``genai-sd``
(openvino-genai's LLMPipeline on the same IRs, without / with ``draft_model``),
``llamacpp`` / ``llamacpp-sd`` (llama.cpp's server on the same GGUF files, without / with
the draft at each K), ``llamacpp-best`` (its fastest speculative configuration on this
machine, ``llamacpp.BEST``; built once by ``python -m benchmarks.llamacpp``).
Modes that draft run once per K, except ``pld`` (it copies up to its own span) and
``best`` (it picks its own K). Every run starts with empty KV caches and greedy decoding.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from benchmarks import llamacpp
from benchmarks.report import add_output_arguments, peak_rss_gib, write_text
from engine import report
from engine.cli import CODING_PROMPTS
from engine.core.budget import GIB
from engine.core.chat import Message
from engine.core.draft_vocab import frequent_ids
from engine.core.memory import peak_resident_bytes, reset_peak_rss
from engine.core.modes import BY_SHORT_NAME
from engine.core.requests import Request
from engine.core.runtime import Runtime
from engine.core.service import Engine
from engine.core.tokenizer import load_tokenizer
from engine.errors import EngineError
from engine.prepare.pipeline import add_model_arguments, cache_dir_from_args, prepare_from_args
from engine.report import Column, markdown_table, speedup
from engine.startup import add_engine_arguments, engine_from_args

NEAR_TIE = 0.05  # a divergence is acceptable only where the target's top-2 logit margin is below this
PEER_MODES = ("genai-ar", "genai-sd", "llamacpp", "llamacpp-sd", "llamacpp-best")
# Peers run once per --k when they draft.
PEERS_PER_K = {"genai-sd", "llamacpp-sd"}
# llama.cpp runs the GGUF's own quantized weights, not the IR's: its tokens are not compared to ar.
OTHER_WEIGHTS = {"llamacpp", "llamacpp-sd", "llamacpp-best"}
# Each engine's plain decoding, which its other modes are measured against ("vs own plain").
PLAIN_OF = {"genai": "genai-ar", "llamacpp": "llamacpp"}
COLUMNS = [
    report.MODE,
    report.TOKENS_PER_S,
    report.SPEEDUP,
    Column("vs own plain", "speedup_vs_own_plain", "{:.2f}×"),
    Column("TTFT s", "ttft_s", "{:.2f}"),
    Column("tokens/s after the first", "after_first_tokens_per_s", "{:.1f}"),
    report.ACCEPTANCE,
    report.MEAN_ACCEPTED,
    Column("identical to ar", "identical_to_ar", "{:.0%}"),
    Column("max margin at divergence", "max_divergence_margin", "{:.3f}"),
]


def per_k(mode: str) -> bool:
    return mode in PEERS_PER_K or (mode in BY_SHORT_NAME and BY_SHORT_NAME[mode].takes_k)


@dataclass
class Run:
    prompt_id: str
    mode: str
    token_ids: list[int]
    text: str
    wall_s: float
    ttft_s: float | None
    new_tokens: int
    drafted: int = 0
    accepted: int = 0
    target_passes: int = 0
    identical_to_ar: bool | None = None
    divergence: dict | None = None
    extra: dict = field(default_factory=dict)


def add_prompt_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", type=Path, default=CODING_PROMPTS)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--limit", type=int, default=None, help="use only the first N prompts")
    parser.add_argument(
        "--history",
        type=int,
        default=0,
        metavar="TOKENS",
        help="a chat history of about this many tokens before each prompt (long-conversation figures)",
    )


def load_prompts(path: Path) -> list[tuple[str, str]]:
    rows = []
    for i, line in enumerate(path.read_text().splitlines()):
        if line.strip():
            row = json.loads(line)
            rows.append((str(row.get("id", i)), row["prompt"]))
    if not rows:
        raise EngineError(f"{path}: no prompts")
    return rows


class GenaiPeer:
    """openvino-genai's LLMPipeline on the same IR folders: the peer, measured in the same run."""

    def __init__(self, target: Path, draft: Path | None, stop_ids: set[int]):
        import openvino_genai as genai

        self.genai = genai
        kwargs = {"draft_model": genai.draft_model(str(draft), "CPU")} if draft else {}
        self.pipe = genai.LLMPipeline(str(target), "CPU", **kwargs)
        self.stop_ids = stop_ids

    def run(self, prompt_ids: list[int], max_new_tokens: int, k: int | None) -> tuple[list[int], float, float]:
        import openvino as ov

        config = self.genai.GenerationConfig()
        config.max_new_tokens = max_new_tokens
        config.stop_token_ids = self.stop_ids
        if k:
            config.num_assistant_tokens = k
        ids = np.asarray([prompt_ids], dtype=np.int64)
        inputs = self.genai.TokenizedInputs(ov.Tensor(ids), ov.Tensor(np.ones_like(ids)))
        start = time.perf_counter()
        result = self.pipe.generate(inputs, config)
        wall = time.perf_counter() - start
        tokens = [t for t in result.tokens[0] if t not in self.stop_ids]
        return tokens, wall, result.perf_metrics.get_ttft().mean / 1000


class Peer(Protocol):
    def run(self, prompt_ids: list[int], max_new_tokens: int, k: int | None) -> tuple[list[int], float, float]:
        """Greedy tokens (stop tokens excluded), wall seconds and time to first token."""


def start_peer(
    mode: str,
    args: argparse.Namespace,
    target_ir: Path,
    draft_ir: Path,
    stop_ids: set[int],
    stack: contextlib.ExitStack,
) -> Peer:
    speculative = mode.endswith("-sd")
    if mode.startswith("genai"):
        return GenaiPeer(target_ir, draft_ir if speculative else None, stop_ids)
    cache_dir = cache_dir_from_args(args)
    model = llamacpp.gguf_file(args.target, cache_dir)
    spec = llamacpp.BEST if mode == "llamacpp-best" else llamacpp.PLAIN
    draft = llamacpp.gguf_file(args.draft, cache_dir) if speculative or spec.draft else None
    context = max(llamacpp.CONTEXT, args.history + 2 * args.max_new_tokens + 1024)  # history, prompt, answer
    peer = llamacpp.LlamaCppPeer(llamacpp.server_binary(cache_dir), model, draft, flags=spec.flags, context=context)
    stack.callback(peer.close)
    return peer


def own_run(engine: Engine, prompt_id: str, prompt_ids: list[int], mode: str, k: int, n: int, label: str) -> Run:
    # Each mode is a client of its own: its n-gram pool holds its own earlier answers, as a server's
    # pool would for one user asking these prompts in turn, and never another mode's answer to the same prompt.
    request = Request(
        prompt_ids=tuple(prompt_ids), mode=mode, k=k, max_new_tokens=n, reuse_cache=False, client=f"bench {label}"
    )
    final = engine.run(request)
    if final.kind == "error":
        raise EngineError(final.error)
    m = final.metrics
    return Run(
        prompt_id,
        label,
        final.token_ids,
        engine.text(final.token_ids),
        m["wall_s"],
        m["ttft_s"],
        m["new_tokens"],
        m["drafted"],
        m["accepted"],
        m["target_passes"],
        extra={
            "target_kv_bytes": m["target_kv_bytes"],
            "draft_kv_bytes": m["draft_kv_bytes"],
            "expected_speedup": m["expected_speedup"],
            "plain_rounds": m["plain_rounds"],
            "pool_drafted": m["pool_drafted"],
            "pool_accepted": m["pool_accepted"],
        },
    )


def top2_margin(target: Runtime, prompt: list[int], prefix: list[int]) -> float:
    """The target's top-2 logit gap after ``prompt + prefix``: how near a tie that step was.

    Computed as autoregressive decoding computes it (the prompt alone, then one token per
    step), since one pass over many tokens rounds differently."""
    target.reset()
    logits = target.forward(prompt)[-1]
    for token in prefix:
        logits = target.forward([token])[-1]
    top = np.partition(logits, -2)[-2:]
    return float(abs(top[1] - top[0]))


def compare_to_ar(engine: Engine, prompt_ids: list[int], ar: Run, run: Run) -> None:
    """Mark identity with ``ar``; at a divergence, record the target's top-2 margin there."""
    run.identical_to_ar = run.token_ids == ar.token_ids
    if run.identical_to_ar:
        return
    n = min(len(ar.token_ids), len(run.token_ids))
    index = next((i for i in range(n) if ar.token_ids[i] != run.token_ids[i]), n)
    margin = engine.with_models(lambda target, _: top2_margin(target, prompt_ids, ar.token_ids[:index]))
    run.divergence = {"index": index, "top2_margin": margin, "near_tie": margin < NEAR_TIE}


def summarize(runs: list[Run], baseline: str = "ar") -> list[dict]:
    """One row of figures per mode; speedups against the ``baseline`` mode."""
    modes = list(dict.fromkeys(r.mode for r in runs))
    by_mode = {m: [r for r in runs if r.mode == m] for m in modes}

    def seconds_per_token(rs: list[Run]) -> float:
        return sum(r.wall_s for r in rs) / sum(r.new_tokens for r in rs)

    ar = seconds_per_token(by_mode[baseline]) if baseline in by_mode else None
    rows = []
    for mode, rs in by_mode.items():
        plain = by_mode.get(PLAIN_OF.get(mode.split("-")[0], baseline))
        drafted = sum(r.drafted for r in rs)
        passes = sum(r.target_passes for r in rs)
        compared = [r for r in rs if r.identical_to_ar is not None]
        divergences = [r.divergence for r in rs if r.divergence]
        rows.append(
            {
                "mode": mode,
                "tokens_per_s": 1 / seconds_per_token(rs),
                "speedup_vs_ar": speedup(ar, seconds_per_token(rs)),
                "speedup_vs_own_plain": speedup(seconds_per_token(plain), seconds_per_token(rs)) if plain else None,
                "ttft_s": statistics.median(r.ttft_s for r in rs if r.ttft_s is not None),
                "after_first_tokens_per_s": sum(r.new_tokens - 1 for r in rs)
                / sum(r.wall_s - (r.ttft_s or 0.0) for r in rs),
                "acceptance_rate": sum(r.accepted for r in rs) / drafted if drafted else None,
                "mean_accepted_length": sum(r.new_tokens for r in rs) / passes if passes else None,
                "identical_to_ar": sum(bool(r.identical_to_ar) for r in compared) / len(compared) if compared else None,
                "max_divergence_margin": max((d["top2_margin"] for d in divergences), default=None),
            }
        )
    return rows


def same_text(runs: list[Run], peer: str = "llamacpp") -> list[Run]:
    """The runs of the prompts on which our plain answer and the ``peer``'s are the same text:
    there the two engines did the same work, so their speeds compare like with like."""
    text = {(r.prompt_id, r.mode): r.text.strip() for r in runs}
    same = {p for p, m in text if m == "ar" and text.get((p, peer)) == text[(p, "ar")]}
    return [r for r in runs if r.prompt_id in same]


# How far `best` may trail the fastest of our fixed modes in one run before --check-best fails.
BEST_TOLERANCE = 0.03


def best_trails(rows: list[dict], tolerance: float = BEST_TOLERANCE) -> str | None:
    """Where `best` is more than ``tolerance`` slower than the fastest of our own fixed modes in
    the same run: what to say of it (None: it is not)."""
    speed = {row["mode"]: row["tokens_per_s"] for row in rows}
    ours = {mode: tps for mode, tps in speed.items() if mode != "best" and mode.split("-k")[0] in BY_SHORT_NAME}
    if "best" not in speed or not ours:
        return None
    fastest = max(ours, key=ours.__getitem__)
    if speed["best"] >= (1 - tolerance) * ours[fastest]:
        return None
    return f"best ({speed['best']:.1f} tokens/s) trails {fastest} ({ours[fastest]:.1f}) by more than {tolerance:.0%}"


def chat_history(engine: Engine, tokens: int) -> tuple[Message, ...]:
    """A conversation of about ``tokens`` tokens to put before each prompt: this project's own
    source pasted in a first turn, and a short reply (a coding chat a few turns in)."""
    if not tokens:
        return ()
    source = "".join(p.read_text() for p in sorted((Path(__file__).resolve().parents[1] / "engine").rglob("*.py")))
    pasted = engine.text(engine.tokenizer.encode(source)[:tokens])
    return (
        {"role": "user", "content": f"Here is the code of my project:\n\n{pasted}"},
        {"role": "assistant", "content": "I have read it. What would you like to know or change?"},
    )


def run_bench(
    engine: Engine,
    prompts: list[tuple[str, str]],
    modes: list[str],
    ks: list[int],
    n: int,
    peers: dict[str, Peer],
    history: tuple[Message, ...] = (),
) -> list[Run]:
    runs: list[Run] = []
    for prompt_id, prompt in prompts:
        prompt_ids = engine.prompt_ids(Request((*history, {"role": "user", "content": prompt})))
        ar = None
        for mode in modes:
            for k in ks if per_k(mode) else [ks[0]]:
                label = f"{mode}-k{k}" if per_k(mode) and len(ks) > 1 else mode
                if mode in BY_SHORT_NAME:
                    run = own_run(engine, prompt_id, prompt_ids, BY_SHORT_NAME[mode].name, k, n, label)
                else:
                    peer = peers[mode]
                    tokens, wall, ttft = peer.run(prompt_ids, n, k if per_k(mode) else None)
                    run = Run(prompt_id, label, tokens, engine.text(tokens), wall, ttft, len(tokens))
                    if isinstance(peer, llamacpp.LlamaCppPeer):  # what its server reports of its drafts
                        run.drafted = int(peer.timings.get("draft_n", 0))
                        run.accepted = int(peer.timings.get("draft_n_accepted", 0))
                if mode == "ar":
                    ar = run
                elif ar is not None and mode not in OTHER_WEIGHTS:
                    compare_to_ar(engine, prompt_ids, ar, run)
                runs.append(run)
                print(
                    f"  {prompt_id:>12} {label:<12} {run.new_tokens / run.wall_s:6.1f} tok/s"
                    f"{'' if run.identical_to_ar in (None, True) else '  (differs from ar)'}",
                    file=sys.stderr,
                )
    return runs


def peak_memory_gib(peers: dict[str, Peer]) -> dict[str, float]:
    """Each engine's peak resident memory, in GiB: this process's since :func:`reset_peak_rss`
    ("ours": our engine with both models, and openvino.genai's peers where they ran, in this
    process) and each llama.cpp server's since it started."""
    ours = "ours with genai" if any(isinstance(peer, GenaiPeer) for peer in peers.values()) else "ours"
    peaks = {ours: peak_resident_bytes() / GIB}
    for mode, peer in peers.items():
        if isinstance(peer, llamacpp.LlamaCppPeer) and (peak := peak_rss_gib(peer.process.pid)):
            peaks[mode] = peak
    return peaks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench", description=__doc__.split("\n\n")[0])
    add_model_arguments(parser)
    add_engine_arguments(parser)  # (the memory limit, the prompt reader and the kernels are read here)
    add_prompt_arguments(parser)
    parser.add_argument("--k", default="4", help="draft lengths, comma separated")
    parser.add_argument(
        "--modes", default="ar,sd", help=f"comma separated, of: {', '.join([*BY_SHORT_NAME, *PEER_MODES])}"
    )
    add_output_arguments(parser)
    parser.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        metavar="N",
        help="the draft head computes the N most frequent token ids only (FR-Spec: engine/core/draft_vocab.npz's "
        "ranking, counted by python -m benchmarks.draft_vocab); default: all",
    )
    parser.add_argument(
        "--check-best",
        action="store_true",
        help=f"exit 1 where best is more than {100 * BEST_TOLERANCE:.0f}%% slower than the fastest of our fixed modes",
    )
    args = parser.parse_args(argv)
    try:
        target, draft = prepare_from_args(args)
        reset_peak_rss()  # (from loading on: a first run's conversion is not the engine's)
        kept = frequent_ids(load_tokenizer(target.path), args.draft_vocab) if args.draft_vocab else None
        engine = engine_from_args(args, target, draft, draft_vocab=kept)
        modes = args.modes.split(",")
        unknown = set(modes) - {*BY_SHORT_NAME, *PEER_MODES}
        if unknown:
            raise EngineError(f"unknown modes: {', '.join(sorted(unknown))}")
        prompts = load_prompts(args.prompts)[: args.limit]
        with contextlib.ExitStack() as stack:
            peers = {
                m: start_peer(m, args, target.path, draft.path, set(engine.stop_ids), stack)
                for m in modes
                if m in PEER_MODES
            }
            ks = [int(k) for k in args.k.split(",")]
            runs = run_bench(engine, prompts, modes, ks, args.max_new_tokens, peers, chat_history(engine, args.history))
            peaks = peak_memory_gib(peers)
    except EngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rows = summarize(runs)
    text = markdown_table(rows, COLUMNS)
    agreed = same_text(runs) if "llamacpp" in modes else []
    if "llamacpp" in modes:
        count = len({r.prompt_id for r in agreed})
        text += f"\n\nOn the {count} of {len(prompts)} prompts where ar and llamacpp wrote the same text:\n\n"
        text += markdown_table(summarize(agreed), COLUMNS) if agreed else "(none)"
    text += "\n\nPeak resident memory: " + ", ".join(f"{name} {gib:.2f} GiB" for name, gib in peaks.items())
    print(text)
    write_text(args.table, text + "\n")
    write_text(
        args.json,
        json.dumps(
            {
                "summary": rows,
                "same_text_summary": summarize(agreed) if agreed else [],
                "runs": [r.__dict__ for r in runs],
                "max_new_tokens": args.max_new_tokens,
                "peak_rss_gib": peaks,
            },
            indent=1,
        ),
    )
    if args.check_best and (trailing := best_trails(rows)):
        print(f"check failed: {trailing}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

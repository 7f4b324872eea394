"""The target's KV cache in pages instead of the IR's own states: what a step, a verify pass and
a rejection cost at growing contexts, and whether the rows stay exact.

    python -m benchmarks.paged_probe [--contexts 64,1000,4000,8000] [--repeats 8] [--json OUT] [--table OUT]

The engine's target keeps its cache in the stateful IR's variables. Rolling back a rejected
token there means reading every state out and setting the kept entries back, O(context): after
8,000 tokens a rejection costs several plain steps (docs/benchmarks.md, "An AVX2 machine").
OpenVINO's paged-attention form of the same IR (``paged_attention_transformation``, what
openvino.genai's continuous batching runs on) takes the cache as block tensors the caller owns and
each sequence's past length as an input: rolling back is passing a smaller length, O(1).

Both forms of the target run here side by side, the contexts set directly (zeros; no prefill),
each measurement interleaved between the two so the machine's drift falls on both: a plain step,
a pass over K + 1 tokens, and a rejection (K entries rolled back, then a step). Before that, on a
short random prompt: how far a pass's rows are from single steps in each form, whether steps
after a paged rollback repeat bit for bit, and how far the two forms' logits are apart.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np
import openvino as ov
from openvino._offline_transformations import paged_attention_transformation

from benchmarks.report import add_output_arguments, write_text
from engine.cli import run_cli
from engine.core.runtime import TARGET_CONFIG, Runtime
from engine.prepare.pipeline import add_model_arguments, prepare_from_args
from engine.report import Column, markdown_table

MEASURED = ("step", "pass", "rejection")
COLUMNS = [
    Column("context", "context"),
    Column("form", "form"),
    Column("step ms", "step_ms", "{:.0f}"),
    Column("K+1 pass ms", "pass_ms", "{:.0f}"),
    Column("rejection ms (rollback + step)", "rejection_ms", "{:.0f}"),
]


class PagedCache:
    """One sequence over a paged-attention IR: its cache in blocks numbered 0, 1, ... (a block
    table that is the identity), allocated once for ``capacity`` tokens."""

    def __init__(self, compiled: ov.CompiledModel, capacity: int):
        self.request = compiled.create_infer_request()
        self.block = compiled.input("key_cache.0").get_partial_shape()[2].get_length()
        blocks = -(-capacity // self.block)
        self.capacity = blocks * self.block
        for port in compiled.inputs:
            if "_cache." in port.get_any_name():
                shape = [d.get_length() if d.is_static else blocks for d in port.get_partial_shape()]
                cache = ov.Tensor(port.get_element_type(), shape)
                cache.data[:] = 0
                self.request.set_tensor(port.get_any_name(), cache)
        self.length = 0

    @classmethod
    def compile(cls, ir_dir: Path, capacity: int, config: dict | None = None) -> PagedCache:
        model = ov.Core().read_model(Path(ir_dir) / "openvino_model.xml")
        paged_attention_transformation(model)
        return cls(ov.Core().compile_model(model, "CPU", TARGET_CONFIG if config is None else config), capacity)

    def forward(self, tokens: Sequence[int]) -> np.ndarray:
        """Append ``tokens``; return the logits of every one of them."""
        n, past = len(tokens), self.length
        if past + n > self.capacity:
            raise ValueError(f"{past + n} tokens exceed the {self.capacity} the cache was allocated for")
        blocks = -(-(past + n) // self.block)
        self.request.infer(
            {
                "input_ids": np.asarray(tokens, dtype=np.int64),
                "position_ids": np.arange(past, past + n, dtype=np.int64),
                "max_context_len": np.array(past + n, dtype=np.int32),
                "past_lens": np.array([past], dtype=np.int32),
                "subsequence_begins": np.array([0, n], dtype=np.int32),
                "block_indices_begins": np.array([0, blocks], dtype=np.int32),
                "block_indices": np.arange(blocks, dtype=np.int32),
            }
        )
        self.length += n
        return self.request.get_tensor("logits").data[:, 0].astype(np.float32, copy=True)

    def trim(self, keep: int) -> None:
        """Roll back to the first ``keep`` entries: the next pass writes over the rest."""
        self.length = min(keep, self.length)

    def fill(self, context: int) -> None:
        """Hold ``context`` entries, whatever the blocks hold (zeros at first): no prefill."""
        self.length = context


def _largest_gap(a: Iterable[np.ndarray], b: Iterable[np.ndarray]) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True))


def exactness(stateful: Runtime, paged: PagedCache, prompt: Sequence[int], added: Sequence[int]) -> dict:
    """After ``prompt``, the rows of one pass over ``added`` against single steps over it, in each
    form; single steps repeated after a paged rollback; and the two forms' steps against each other."""
    stateful.reset()
    stateful.forward(prompt)
    steps = [stateful.forward([t])[0] for t in added]
    stateful.trim(len(prompt))
    stateful_pass = stateful.forward(added, rows=len(added))
    paged.trim(0)
    paged.forward(prompt)
    paged_steps = [paged.forward([t])[0] for t in added]
    paged.trim(len(prompt))
    paged_pass = paged.forward(added)
    paged.trim(len(prompt))
    repeated = [paged.forward([t])[0] for t in added]
    return {
        "stateful_pass_vs_steps": _largest_gap(stateful_pass, steps),
        "paged_pass_vs_steps": _largest_gap(paged_pass, paged_steps),
        "paged_steps_after_rollback": _largest_gap(repeated, paged_steps),
        "paged_vs_stateful": _largest_gap(paged_steps, steps),
        "same_argmax": all(int(x.argmax()) == int(y.argmax()) for x, y in zip(paged_steps, steps, strict=True)),
    }


def _seconds(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def costs_at(stateful: Runtime, paged: PagedCache, context: int, k: int, repeats: int) -> list[dict]:
    """Median step, K+1 pass and rejection of each form after ``context`` tokens, interleaved."""
    stateful.fill(context)
    paged.fill(context)
    for form in (stateful, paged):  # the first pass of each shape after a change sets it up
        form.forward([0])
        form.forward([0] * (k + 1))
        form.trim(context)
    forms: dict[str, tuple[Callable[[list[int]], object], Callable[[int], None], Callable[[], int]]] = {
        "stateful": (lambda t: stateful.forward(t, rows=len(t)), stateful.trim, lambda: len(stateful.tokens)),
        "paged": (paged.forward, paged.trim, lambda: paged.length),
    }
    times: dict[str, list[tuple[float, float, float]]] = {name: [] for name in forms}
    for _ in range(repeats):
        for name, calls in forms.items():
            times[name].append(_one_round(*calls, k))
    return [
        {
            "context": context,
            "form": name,
            **{f"{what}_ms": 1000 * statistics.median(column) for what, column in zip(MEASURED, zip(*rounds))},
        }
        for name, rounds in times.items()
    ]


def _one_round(
    forward: Callable[[list[int]], object], trim: Callable[[int], None], length: Callable[[], int], k: int
) -> tuple[float, float, float]:
    """Seconds of a step, a pass over K + 1 tokens, and a rejection (K rolled back, then a step)."""
    step = _seconds(lambda: forward([0]))
    verify = _seconds(lambda: forward([0] * (k + 1)))
    keep = length() - k

    def rejection() -> None:
        trim(keep)
        forward([0])

    return step, verify, _seconds(rejection)


def probe(args: argparse.Namespace) -> None:
    target, _ = prepare_from_args(args)
    contexts = [int(c) for c in args.contexts.split(",")]
    stateful = Runtime(target.path, config=TARGET_CONFIG, first_token_alone=True)
    stateful.warm_up()
    paged = PagedCache.compile(target.path, max(contexts) + 4 * (args.k + 2) * args.repeats)
    rng = np.random.default_rng(0)
    vocab = min(stateful.vocab_size, 30000)
    prompt, added = ([int(t) for t in rng.integers(100, vocab, n)] for n in (48, args.k + 1))
    exact = exactness(stateful, paged, prompt, added)
    rows = [row for context in contexts for row in costs_at(stateful, paged, context, args.k, args.repeats)]
    text = (
        f"Largest logit differences after a {len(prompt)}-token prompt: a {len(added)}-token pass against "
        f"single steps {exact['stateful_pass_vs_steps']:.2e} (stateful) and {exact['paged_pass_vs_steps']:.2e} "
        f"(paged); single steps after a paged rollback against the first ones "
        f"{exact['paged_steps_after_rollback']:.2e}; paged against stateful steps "
        f"{exact['paged_vs_stateful']:.2e} (same argmax: {exact['same_argmax']}).\n\n" + markdown_table(rows, COLUMNS)
    )
    print(text)
    write_text(args.table, text + "\n")
    write_text(args.json, json.dumps({"exactness": exact, "rows": rows}, indent=1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.paged_probe", description=__doc__.split("\n\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--contexts", default="64,1000,4000,8000", help="context lengths, comma separated")
    parser.add_argument("--k", type=int, default=4, help="drafted tokens per round: passes of K + 1, K rolled back")
    parser.add_argument("--repeats", type=int, default=8, help="measurements per figure (the median is shown)")
    add_output_arguments(parser)
    return run_cli(lambda: probe(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())

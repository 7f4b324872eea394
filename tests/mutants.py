"""A small mutation check: does the fast suite notice when a behaviour a user relies on breaks?

    python -m tests.mutants            # every mutation below (make mutants)
    python -m tests.mutants --list     # what each one breaks
    python -m tests.mutants top-p      # only the mutations whose name contains "top-p"

Each mutation is a one-line change to the engine or the app. For each, a copy of the project is
mutated and the fast suite runs on it (the tests most likely to notice first, then the rest,
stopping at the first failure). A mutation that leaves every test green has survived: the
command fails and names it.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FAST = ["-m", "not real and not browser and not cluster and not slow"]  # make test-fast
COPIED = ("app.py", "engine", "ui", "benchmarks", "tests", "assets", "pytest.ini", "pyproject.toml")


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str
    old: str
    new: str
    breaks: str  # what a user would see
    first: str  # the test (file or node id) most likely to catch it, run before the rest


MUTATIONS = [
    Mutation(
        "ranges never checked",
        "engine/core/requests.py",
        "if above and value <= high:",
        "if True:",
        "a NaN temperature silently produces garbage",
        "tests/test_hardening.py",
    ),
    Mutation(
        "a cache kept whoever wrote it",
        "engine/core/reading.py",
        "if shared < p.stop or any(origin != p for origin in cache.origins[p.start : p.stop]):",
        "if shared < p.stop:",
        "an answer depends on what the cache held before: entries another pass wrote are kept",
        "tests/test_reader.py",
    ),
    Mutation(
        "typed control tokens parsed",
        "engine/core/chat.py",
        "split_special_tokens=True",
        "split_special_tokens=False",
        "a user can open a system turn by typing its tokens",
        "tests/test_hardening.py",
    ),
    Mutation(
        "prefill not cancellable",
        "engine/core/scheduler.py",
        "        if job.cancelled:\n            self._finish(job, FinishReason.CANCELLED)\n        elif",
        "        if False:\n            self._finish(job, FinishReason.CANCELLED)\n        elif",
        "Stop during a long prompt waits for the whole prefill",
        "tests/test_hardening.py",
    ),
    Mutation(
        "top-p ignored",
        "engine/core/sampling.py",
        "if params.top_p < 1.0:",
        "if False:",
        "the Top-p slider does nothing",
        "tests/test_sampling.py",
    ),
    Mutation(
        "temperature ignored",
        "engine/core/sampling.py",
        "z /= params.temperature",
        "z /= 1.0",
        "every temperature behaves like 1.0",
        "tests/test_sampling.py",
    ),
    Mutation(
        "top-k ignored",
        "engine/core/sampling.py",
        "if 0 < params.top_k < z.shape[-1]:",
        "if False:",
        "top-k does nothing",
        "tests/test_sampling.py",
    ),
    Mutation(
        "cancel never checked",
        "engine/core/scheduler.py",
        "elif job.cancelled:",
        "elif False:",
        "Stop and closed tabs no longer stop the engine",
        "tests/test_decoding.py::test_cancelling_a_stream_stops_the_engine_within_one_round",
    ),
    Mutation(
        "stop tokens ignored",
        "engine/core/decoding.py",
        "if t in self.config.stop_ids",
        "if False",
        "answers run past end-of-turn to the token limit",
        "tests/test_decoding.py::test_a_stop_token_ends_the_answer_with_nothing_after_it",
    ),
    Mutation(
        "stop strings ignored",
        "engine/core/textstream.py",
        "return text[: min(hits)], True",
        "return text, True",
        "a stop string shows in the answer",
        "tests/test_textstream.py",
    ),
    Mutation(
        "cache never reused",
        "engine/core/scheduler.py",
        "if not job.request.reuse_cache:",
        "if True:",
        "every turn re-prefills the whole chat",
        "tests/test_decoding.py::test_multi_turn_reuses_the_cache_and_equals_a_fresh_run",
    ),
    Mutation(
        "lookup copies one too far",
        "engine/core/drafters.py",
        "context[best : best + k]",
        "context[best + 1 : best + 1 + k]",
        "prompt lookup drafts the wrong tokens (slower)",
        "tests/test_decoding.py::test_lookup_proposes_the_exact_continuation_of_the_best_earlier_match",
    ),
    Mutation(
        "adaptive K never grows",
        "engine/core/drafters.py",
        "current + 2 if accepted == drafted",
        "current - 1 if accepted == drafted",
        "adaptive mode drafts ever fewer tokens (slower)",
        "tests/test_decoding.py::test_adaptive_k_grows_after_full_acceptance_and_shrinks_after_a_rejection",
    ),
    Mutation(
        "hybrid adapts on lookup drafts",
        "engine/core/drafters.py",
        "(self.model if self._model_proposed else self.lookup)",
        "(self.model if True else self.lookup)",
        "the draft model's K moves on prompt lookup's verdicts",
        "tests/test_decoding.py::test_a_hybrid_adapts_its_model_only_on_the_model_s_own_drafts",
    ),
    Mutation(
        "accept rule always accepts",
        "engine/core/speculative.py",
        "if rng.random() * q[i, token] < p[i, token]:",
        "if True:",
        "sampled answers follow the draft, not the target",
        "tests/test_speculative.py::test_a_rejected_token_is_resampled_from_the_residual",
    ),
    Mutation(
        "greedy accept off by one",
        "engine/core/speculative.py",
        "return n, int(best[n])",
        "return n, int(best[max(0, n - 1)])",
        "greedy answers differ from the target's",
        "tests/test_speculative.py",
    ),
    Mutation(
        "trim is a no-op",
        "engine/core/runtime.py",
        "if keep >= len(self.tokens):",
        "if True:",
        "rejected drafts stay in the cache: wrong answers",
        "tests/test_decoding.py::test_logits_after_trim_equal_a_fresh_run",
    ),
    Mutation(
        "masked rollback shifted",
        "engine/core/runtime.py",
        "self._mask[slots[keep] :] = 0",
        "self._mask[slots[keep] + 1 :] = 0",
        "the draft attends to a rejected token",
        "tests/test_runtime.py",
    ),
    Mutation(
        "half characters streamed",
        "engine/core/textstream.py",
        'if after.endswith("\\ufffd") or',
        "if",
        "broken characters appear while streaming",
        "tests/test_textstream.py",
    ),
    Mutation(
        "the chat ignores its mode",
        "ui/streaming.py",
        "mode=settings.mode,\n        k=settings.k,",
        'mode="autoregressive",\n        k=settings.k,',
        "the mode radio does nothing",
        "tests/ui/test_chat.py",
    ),
    Mutation(
        "colouring ignored",
        "ui/render.py",
        'if colour and turn.get("pieces"):',
        "if False:",
        "the provenance colours never show",
        "tests/ui/test_chat.py",
    ),
]


def mutate(tree: Path, mutation: Mutation) -> None:
    path = tree / mutation.path
    text = path.read_text()
    if text.count(mutation.old) != 1:
        raise SystemExit(
            f"mutation '{mutation.name}': the line to change is not found once in {mutation.path} "
            f"(has the code moved? update tests/mutants.py)"
        )
    path.write_text(text.replace(mutation.old, mutation.new))


def caught(mutation: Mutation | None, timeout_s: float) -> tuple[bool, float]:
    """Run the fast suite on a mutated copy (unmutated for None); True when some test fails.
    Only failing tests count: a suite that cannot run (a moved test, a collection error) is an
    error of the check itself."""
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mutant-") as folder:
        tree = Path(folder)
        for name in COPIED:
            source = ROOT / name
            if source.is_dir():
                shutil.copytree(source, tree / name, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy2(source, tree / name)
        if mutation is not None:
            mutate(tree, mutation)
        first = mutation.first if mutation else "tests/test_sampling.py"
        for tests in ([first], ["tests", "--deselect", first]):
            command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *FAST, *tests]
            try:
                result = subprocess.run(command, cwd=tree, capture_output=True, text=True, timeout=timeout_s)
            except subprocess.TimeoutExpired:
                return True, time.monotonic() - start  # a hang is noticed too
            if result.returncode == 1:  # tests ran, and some failed
                return True, time.monotonic() - start
            if result.returncode not in (0, 5):  # 5: no test selected
                raise SystemExit(
                    f"the suite could not run ({'mutation ' + mutation.name if mutation else 'unmutated'}"
                    f", exit {result.returncode}):\n{result.stdout[-2000:]}"
                )
    return False, time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.mutants", description=__doc__.split("\n\n")[0])
    parser.add_argument("only", nargs="*", help="run only mutations whose name contains one of these")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument(
        "--timeout", type=float, default=1800, help="seconds per test run (more than the whole fast suite takes)"
    )
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.only or any(word in m.name for word in args.only)]
    if args.list:
        for m in chosen:
            print(f"{m.name:<32} {m.path:<28} {m.breaks}")
        return 0
    if caught(None, args.timeout)[0]:
        raise SystemExit("the fast suite fails without any mutation: fix it first")
    survivors = []
    for m in chosen:
        found, seconds = caught(m, args.timeout)
        print(f"{'caught  ' if found else 'SURVIVED'} {m.name:<32} {seconds:6.0f} s  ({m.breaks})", flush=True)
        if not found:
            survivors.append(m.name)
    print(f"{len(chosen) - len(survivors)} of {len(chosen)} mutations caught")
    if survivors:
        print(f"survived: {', '.join(survivors)}: add a test that fails on each", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

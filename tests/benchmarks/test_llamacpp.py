"""The llama.cpp peer: its errors, and (where llama.cpp is built) a real server on a tiny GGUF."""

from __future__ import annotations

import pytest

from benchmarks import llamacpp
from benchmarks.bench import peak_memory_gib
from engine.core.budget import GIB
from engine.core.memory import resident_bytes
from engine.errors import EngineError
from engine.prepare.pipeline import default_cache_dir
from tests.gguf_writer import write_gguf

SERVER = llamacpp.server_binary(default_cache_dir())


def test_a_missing_server_says_how_to_build_it(tmp_path):
    with pytest.raises(EngineError, match=r"python -m benchmarks\.llamacpp"):
        llamacpp.LlamaCppPeer(tmp_path / "llama-server", tmp_path / "model.gguf")


def test_a_server_that_fails_to_start_reports_its_output(tmp_path):
    failing = tmp_path / "llama-server"
    failing.write_text("#!/bin/sh\necho 'error loading model: not a GGUF file'\nexit 1\n")
    failing.chmod(0o755)
    with pytest.raises(EngineError, match=r"exited \(1\):\nerror loading model: not a GGUF file"):
        llamacpp.LlamaCppPeer(failing, tmp_path / "model.gguf")


def test_the_llama_cpp_modes_need_a_gguf_model(ir_target, tiny_cache):
    with pytest.raises(EngineError, match="need a GGUF model"):
        llamacpp.gguf_file(str(ir_target), tiny_cache)


@pytest.mark.skipif(not SERVER.exists(), reason="llama.cpp is not built (python -m benchmarks.llamacpp)")
def test_the_server_decodes_greedily_from_a_gguf(hf_target, tiny_dir, tiny_cache):
    (tiny_dir / "gguf").mkdir(exist_ok=True)
    gguf = write_gguf(hf_target, tiny_dir / "gguf" / "tiny-qwen2.gguf")
    assert llamacpp.gguf_file(str(gguf), tiny_cache) == gguf
    peer = llamacpp.LlamaCppPeer(SERVER, gguf, threads=1)
    try:
        first, wall, ttft = peer.run([5, 17, 42, 99], 12, None)
        again, _, _ = peer.run([5, 17, 42, 99], 12, None)
        peaks = peak_memory_gib({"llamacpp": peer})
    finally:
        peer.close()
    assert 0 < len(first) <= 12 and first == again
    assert wall > 0 and ttft >= 0
    assert peaks["ours"] >= resident_bytes() / GIB * 0.9 and 0 < peaks["llamacpp"] < peaks["ours"]  # (a tiny model)
    assert peer.process.poll() is not None
    with pytest.raises(EngineError, match="did not answer"):  # a server that is gone
        peer.run([5, 17, 42, 99], 4, None)


def test_the_sweep_ranks_configurations_by_their_speedup_over_plain_on_every_set():
    """Speedups are per set against plain llama.cpp in the same run; the ranking is their
    geometric mean, so a configuration that wins big on one set and loses on the other does not
    beat a steady one by its average alone."""
    from benchmarks.llamacpp_sweep import Tally, summarize

    plain, steady, lopsided = llamacpp.PLAIN.name, "draft n_max 5", "ngram-mod"
    tallies = {
        plain: {"coding": Tally(100, 10.0), "general": Tally(100, 10.0)},
        steady: {"coding": Tally(100, 8.0, 40, 30), "general": Tally(100, 8.0, 40, 20)},  # 1.25x on both
        lopsided: {"coding": Tally(100, 5.0, 10, 9), "general": Tally(100, 25.0)},  # 2x and 0.4x
    }
    rows = summarize(tallies)
    assert [r["configuration"] for r in rows] == [steady, plain, lopsided]
    assert rows[0]["coding_vs_plain"] == pytest.approx(1.25) and rows[0]["coding_acceptance"] == 0.75
    assert rows[2]["general_acceptance"] is None and rows[1]["flags"] is None
    assert rows[2]["mean_vs_plain"] == pytest.approx((2.0 * 0.4) ** 0.5)


def test_the_peer_at_its_best_is_one_of_the_swept_configurations():
    assert llamacpp.BEST in llamacpp.SWEEP and llamacpp.BY_NAME[llamacpp.BEST.name] is llamacpp.BEST
    assert all(s.draft == ("--spec-type" in s.flags and "draft-simple" in " ".join(s.flags)) for s in llamacpp.SWEEP)


@pytest.mark.skipif(not SERVER.exists(), reason="llama.cpp is not built (python -m benchmarks.llamacpp)")
def test_every_swept_configuration_starts_and_decodes(hf_target, hf_draft, tiny_dir):
    """The sweep's flags are llama-server's of the version we build: each configuration starts
    and answers greedily (a flag it does not know would stop it at start)."""
    (tiny_dir / "gguf").mkdir(exist_ok=True)
    target = write_gguf(hf_target, tiny_dir / "gguf" / "tiny-qwen2.gguf")
    draft = write_gguf(hf_draft, tiny_dir / "gguf" / "tiny-qwen2-draft.gguf")
    for spec in llamacpp.SWEEP:
        peer = llamacpp.LlamaCppPeer(SERVER, target, draft if spec.draft else None, threads=1, flags=spec.flags)
        try:
            tokens, _, _ = peer.run([5, 17, 42, 99, 5, 17, 42], 12, None)
        finally:
            peer.close()
        assert 0 < len(tokens) <= 12, spec.name

"""The llama.cpp peer: its errors, and (where llama.cpp is built) a real server on a tiny GGUF."""

from __future__ import annotations

import pytest

from engine.errors import EngineError
from engine.prepare.pipeline import default_cache_dir
from engine.tools import llamacpp
from tests.gguf_writer import write_gguf

SERVER = llamacpp.server_binary(default_cache_dir())


def test_a_missing_server_says_how_to_build_it(tmp_path):
    with pytest.raises(EngineError, match=r"python -m engine\.tools\.llamacpp"):
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


@pytest.mark.skipif(not SERVER.exists(), reason="llama.cpp is not built (python -m engine.tools.llamacpp)")
def test_the_server_decodes_greedily_from_a_gguf(hf_target, tiny_dir, tiny_cache):
    (tiny_dir / "gguf").mkdir(exist_ok=True)
    gguf = write_gguf(hf_target, tiny_dir / "gguf" / "tiny-qwen2.gguf")
    assert llamacpp.gguf_file(str(gguf), tiny_cache) == gguf
    peer = llamacpp.LlamaCppPeer(SERVER, gguf, threads=1)
    try:
        first, wall, ttft = peer.run([5, 17, 42, 99], 12, None)
        again, _, _ = peer.run([5, 17, 42, 99], 12, None)
    finally:
        peer.close()
    assert 0 < len(first) <= 12 and first == again
    assert wall > 0 and ttft >= 0
    assert peer.process.poll() is not None
    with pytest.raises(EngineError, match="did not answer"):  # a server that is gone
        peer.run([5, 17, 42, 99], 4, None)

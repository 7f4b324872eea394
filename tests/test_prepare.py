"""Model preparation: every source kind through the real conversion path, and its errors."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import shutil
import subprocess
import sys
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from tqdm import tqdm

from engine.errors import PrepareError
from engine.prepare import disk, embedded
from engine.prepare import pipeline as prepare
from engine.prepare.convert import Compression
from engine.prepare.pipeline import prepare_one
from engine.prepare.sources import Kind, Source
from engine.prepare.vocab import Vocabulary
from tests.gguf_writer import write_gguf
from tests.tiny import TOKENS, build_model, build_tokenizer, ov_logits


def torch_logits(hf_folder: Path, tokens: list[int]) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_folder, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].numpy()


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "engine.prepare", *args],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parent.parent,
    )


@pytest.mark.parametrize("which", ["qwen2", "llama"])
def test_hf_folder_becomes_an_ir_whose_logits_match_torch(which, hf_target, hf_llama, tiny_cache):
    hf = hf_target if which == "qwen2" else hf_llama
    ir = prepare_one(str(hf), Compression("fp16"), tiny_cache).path
    expected, got = torch_logits(hf, TOKENS), ov_logits(ir, TOKENS)
    np.testing.assert_allclose(got, expected, atol=0.05)
    assert (got.argmax(-1) == expected.argmax(-1)).all()


def test_gguf_file_becomes_an_ir_whose_logits_match_torch(hf_target, tiny_dir, tiny_cache):
    (tiny_dir / "gguf").mkdir(exist_ok=True)
    gguf = write_gguf(hf_target, tiny_dir / "gguf" / "tiny-qwen2.gguf")
    prepared = prepare_one(str(gguf), Compression("fp16"), tiny_cache)
    manifest = json.loads((prepared.path / "manifest.json").read_text())
    assert manifest["kind"] == "gguf" and manifest["sha256"] == embedded.sha256_file(gguf)
    assert {"openvino", "nncf", "optimum-intel"} <= set(manifest["versions"])
    np.testing.assert_allclose(ov_logits(prepared.path, TOKENS), torch_logits(hf_target, TOKENS), atol=0.05)
    # a GGUF target and a Hugging Face draft of one tokenizer pass the pair check
    assert Vocabulary.of(Source("g", Kind.GGUF, gguf)) == Vocabulary.of(Source("h", Kind.HF_FOLDER, hf_target))


@pytest.mark.parametrize("precision,min_correlation", [("int8", 0.99), ("int4", 0.8)])
def test_compressed_irs_run_and_stay_close_to_fp16(precision, min_correlation, hf_target, tiny_cache):
    ir = prepare_one(str(hf_target), Compression(precision, group_size=32), tiny_cache).path
    fp16 = prepare_one(str(hf_target), Compression("fp16"), tiny_cache).path
    got, ref = ov_logits(ir, TOKENS), ov_logits(fp16, TOKENS)
    assert np.isfinite(got).all()
    assert np.corrcoef(got.ravel(), ref.ravel())[0, 1] > min_correlation
    assert (ir / "openvino_model.bin").stat().st_size < (fp16 / "openvino_model.bin").stat().st_size


def test_second_prepare_is_a_cache_hit_in_under_two_seconds(hf_target, hf_draft, tiny_cache):
    args = [
        "--target",
        str(hf_target),
        "--draft",
        str(hf_draft),
        "--target-precision",
        "fp16",
        "--draft-precision",
        "fp16",
        "--cache-dir",
        str(tiny_cache),
        "--json",
    ]
    first = run_cli(*args)
    assert first.returncode == 0, first.stderr
    start = time.perf_counter()
    second = run_cli(*args)
    assert time.perf_counter() - start < 2.0
    assert second.returncode == 0 and "already prepared" in second.stderr
    result = json.loads(second.stdout)
    assert result == json.loads(first.stdout)
    assert set(result["target"]) == {"path", "precision", "source", "sha256"}


def test_draft_with_another_tokenizer_is_refused(tiny_dir, hf_target, tiny_cache):
    other_tok = tiny_dir / "other-tokenizer"
    build_tokenizer(other_tok, vocab_size=300, extra_corpus=("completely different words",))
    other = build_model(tiny_dir / "hf-other", other_tok, "llama", seed=4)
    result = run_cli("--target", str(hf_target), "--draft", str(other), "--cache-dir", str(tiny_cache), "--json")
    assert result.returncode != 0
    assert "does not share the tokenizer" in result.stderr and "hf-other" in result.stderr
    assert result.stdout == ""


def _fake_wheels(folder: Path, chunks: list[bytes | None]) -> tuple[embedded.EmbeddedGGUF, list[Path]]:
    data = b"".join(c for c in chunks if c)
    spec = embedded.EmbeddedGGUF(
        "fake", "fake-part", len(chunks), "1.0", "fake.gguf", len(data), hashlib.sha256(data).hexdigest()
    )
    wheels = []
    for i, (pkg, chunk) in enumerate(zip(spec.packages(), chunks), start=1):
        path = folder / f"{pkg.replace('-', '_')}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(path, "w") as z:
            z.writestr(f"{pkg.replace('-', '_')}/__init__.py", "")
            if chunk is not None:
                z.writestr(f"{pkg.replace('-', '_')}/data/part{i:02d}.bin", chunk)
        wheels.append(path)
    return spec, wheels


def test_chunks_assemble_into_the_pinned_file(tmp_path):
    spec, wheels = _fake_wheels(tmp_path, [b"abc" * 1000, b"def" * 1000])
    embedded.assemble(spec, wheels, tmp_path / "out.gguf")
    assert (tmp_path / "out.gguf").read_bytes() == b"abc" * 1000 + b"def" * 1000


def test_corrupt_chunk_is_reported_and_nothing_is_left(tmp_path):
    spec, _wheels = _fake_wheels(tmp_path, [b"abc" * 1000, b"def" * 1000])
    (tmp_path / "bad").mkdir()
    _, bad = _fake_wheels(tmp_path / "bad", [b"abc" * 1000, b"dXf" * 1000])
    with pytest.raises(PrepareError, match=r"sha256.*fake-part1\.\.2==1\.0.*pip cache purge"):
        embedded.assemble(spec, bad, tmp_path / "out.gguf")
    assert not list(tmp_path.glob("out.*"))


def test_missing_chunk_names_the_package(tmp_path):
    spec, _ = _fake_wheels(tmp_path, [b"abc" * 1000, b"def" * 1000])
    (tmp_path / "m").mkdir()
    _, missing = _fake_wheels(tmp_path / "m", [b"abc" * 1000, None])
    with pytest.raises(PrepareError, match="fake-part2"):
        embedded.assemble(spec, missing, tmp_path / "out.gguf")
    assert not list(tmp_path.glob("out.*"))


def test_unknown_architecture_is_refused(tiny_dir, hf_target, tiny_cache):
    odd = tiny_dir / "hf-odd"
    shutil.copytree(hf_target, odd, dirs_exist_ok=True)
    config = json.loads((odd / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**config, "model_type": "weirdnet"}))
    with pytest.raises(PrepareError, match="unknown model architecture 'weirdnet'"):
        prepare_one(str(odd), Compression("fp16"), tiny_cache)


def test_ready_ir_folder_is_used_as_is(ir_target, tiny_cache):
    prepared = prepare_one(str(ir_target), Compression("int4"), tiny_cache)
    assert prepared.path == ir_target and prepared.precision == "as-is"


def test_incomplete_ir_folder_is_refused(ir_target, tmp_path):
    broken = tmp_path / "broken-ir"
    shutil.copytree(ir_target, broken)
    (broken / "openvino_model.bin").unlink()
    with pytest.raises(PrepareError, match=r"missing openvino_model\.bin"):
        prepare_one(str(broken), Compression("int4"), tmp_path)


def test_missing_path_gets_a_clear_message(tmp_path):
    with pytest.raises(PrepareError, match="no such file or folder"):
        prepare_one(str(tmp_path / "nope"), Compression("int4"), tmp_path)


def test_hub_id_fails_fast_where_the_hub_is_unreachable(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    start = time.perf_counter()
    with pytest.raises(PrepareError, match="not reachable"):
        prepare_one("someone/some-model", Compression("int4"), tmp_path)
    assert time.perf_counter() - start < 10


def test_not_enough_disk_is_refused_before_starting(monkeypatch, hf_target, tmp_path):
    monkeypatch.setattr(shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(10, 10, 1))
    with pytest.raises(PrepareError, match="not enough free disk"):
        prepare_one(str(hf_target), Compression("int8"), tmp_path / "cache")
    assert not list((tmp_path / "cache").glob("ir/*"))


def test_interrupted_conversion_leaves_no_entry(monkeypatch, hf_target, tmp_path):
    def boom(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(prepare, "export_ir", boom)
    with pytest.raises(KeyboardInterrupt):
        prepare_one(str(hf_target), Compression("int8"), tmp_path)
    assert [p.name for p in (tmp_path / "ir").iterdir() if p.suffix != ".lock"] == []


def test_a_disk_that_fills_up_mid_conversion_is_reported_as_full(monkeypatch, hf_target, tmp_path):
    def full(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(prepare, "export_ir", full)
    with pytest.raises(PrepareError, match="disk filled up while trying to convert"):
        prepare_one(str(hf_target), Compression("int8"), tmp_path)
    assert [p.name for p in (tmp_path / "ir").iterdir() if p.suffix != ".lock"] == []


def test_a_full_disk_while_assembling_chunks_is_not_called_a_corrupt_package(tmp_path):
    spec, wheels = _fake_wheels(tmp_path, [b"abc" * 1000, b"def" * 1000])

    class FullDisk:
        def write(self, _block):
            raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError) as raised:
        embedded._copy_chunk(spec.packages()[0], spec.version, wheels[0], FullDisk(), tqdm(disable=True))
    assert raised.value.errno == errno.ENOSPC
    with pytest.raises(PrepareError, match="disk filled up"), disk.full_disk_reported(tmp_path, "assemble"):
        raise raised.value


def test_two_prepares_of_one_model_at_once_convert_it_once(monkeypatch, hf_target, tmp_path):
    exports = []
    export = prepare.export_ir
    monkeypatch.setattr(prepare, "export_ir", lambda *a, **kw: (exports.append(1), time.sleep(1), export(*a, **kw)))
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: prepare_one(str(hf_target), Compression("int8"), tmp_path), range(2)))
    assert results[0].path == results[1].path and len(exports) == 1


def test_temporary_folders_of_an_interrupted_run_are_removed_next_time(tmp_path):
    (tmp_path / "ir" / ".build-old").mkdir(parents=True)
    (tmp_path / "ir" / ".build-old" / "model.bin").write_bytes(b"x" * 1000)
    (tmp_path / "gguf" / ".download-busy").mkdir(parents=True)
    said = []
    with open(disk.lock_path(tmp_path / "gguf", "busy"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a run still writing this one
        disk.remove_stale(tmp_path, said.append)
    assert not (tmp_path / "ir" / ".build-old").exists() and (tmp_path / "gguf" / ".download-busy").exists()
    assert len(said) == 1 and ".build-old" in said[0]


def test_chunk_packages_are_downloaded_as_wheels_only(monkeypatch, tmp_path):
    commands = []
    monkeypatch.setattr(embedded.subprocess, "run", lambda cmd, **_: commands.append(cmd) or FailedRun())
    spec = embedded.EMBEDDED["qwen2.5-coder-0.5b"]
    with pytest.raises(PrepareError, match="could not download"):
        embedded._download_wheels(spec, tmp_path)
    assert commands[0][commands[0].index("--only-binary") + 1] == ":all:" and "--no-deps" in commands[0]


class FailedRun:
    returncode, stderr = 1, "ERROR: no such package"


@pytest.mark.parametrize(
    "flags, env, expected",
    [
        ([], None, "gguf"),
        ([], "int4", "int4"),
        (["--target-precision", "fp16"], "int4", "fp16"),
    ],
)
def test_the_target_keeps_its_gguf_blocks_unless_asked_and_the_draft_is_int4(monkeypatch, flags, env, expected):
    import argparse

    if env is None:
        monkeypatch.delenv("SPECCHAT_TARGET_PRECISION", raising=False)
    else:
        monkeypatch.setenv("SPECCHAT_TARGET_PRECISION", env)
    monkeypatch.delenv("SPECCHAT_DRAFT_PRECISION", raising=False)
    parser = argparse.ArgumentParser()
    prepare.add_model_arguments(parser)
    asked = {}
    monkeypatch.setattr(prepare, "prepare_pair", lambda t, d, tc, dc, cache: asked.update(target=tc, draft=dc))
    prepare.prepare_from_args(parser.parse_args(flags))
    assert asked["target"].precision == expected and asked["draft"].precision == "int4"


def test_a_childs_output_shows_as_it_comes_and_a_quiet_one_says_how_long_it_has_run(capfd, caplog):
    from engine.prepare.convert import run_child

    script = "import sys, time; print('step 1', flush=True); time.sleep(0.5); print('step 2'); sys.exit(3)"
    with caplog.at_level("INFO", logger="specchat.prepare"), pytest.raises(PrepareError) as failed:
        run_child([sys.executable, "-c", script], "a step", quiet_after=0.2)
    assert "a step failed (exit 3)" in str(failed.value) and "step 1\nstep 2" in str(failed.value)
    assert "step 1" in capfd.readouterr().err
    assert any("a step:" in r.message and "s so far" in r.message for r in caplog.records)

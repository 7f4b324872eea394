"""GGUF / Hugging Face model -> stateful OpenVINO IR, weights compressed by NNCF; a GGUF's
tokenizer as Hugging Face files (for a graph built from the file, engine.prepare.gguf_graph).

Steps that import transformers (GGUF dequantization, optimum-intel export, the tokenizer) run in
child processes so that their peak memory is returned to the system before the next step starts.
"""

from __future__ import annotations

import codecs
import collections
import logging
import os
import select
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from engine.errors import PrepareError
from engine.hf import auto_tokenizer, hide_unloadable_torchvision
from engine.prepare import gguf_file

_log = logging.getLogger("specchat.prepare")  # (engine.prepare.pipeline prints it)
# "gguf": a GGUF's own quantized blocks kept as they are (engine.prepare.gguf_blocks).
PRECISIONS = ("gguf", "int4", "int8", "fp16")


@dataclass(frozen=True)
class Compression:
    """NNCF weight compression, as optimum-cli exposes it."""

    precision: str = "int4"
    group_size: int = 128
    ratio: float = 1.0
    all_layers: bool = False
    # Symmetric weights: on an AVX2 CPU without VNNI the plugin's int4 kernel runs a decode step
    # faster than with zero points, for the same top-1 agreement; on AVX-512 the two were within
    # noise (docs/benchmarks.md, "An AVX2 machine").
    sym: bool = True

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise PrepareError(f"unknown precision '{self.precision}': choose one of {', '.join(PRECISIONS)}")
        if not 0.0 < self.ratio <= 1.0:
            raise PrepareError(f"ratio must be in (0, 1], got {self.ratio}")

    def cli_args(self) -> list[str]:
        if self.precision == "gguf":  # exported as fp16, then the file's blocks put back
            return ["--weight-format", "fp16"]
        args = ["--weight-format", self.precision]
        if self.precision == "int4":
            args += ["--group-size", str(self.group_size), "--ratio", str(self.ratio)]
            if self.all_layers:
                args.append("--all-layers")
        if self.precision in ("int4", "int8") and self.sym:
            args.append("--sym")
        return args

    def as_dict(self) -> dict:
        return asdict(self)


def run_child(args: list[str], what: str, quiet_after: float = 30.0) -> None:
    """Run a heavy step in a child process. Its output, progress bars included, goes to stderr as
    it comes; where it says nothing for ``quiet_after`` seconds (a model being traced), a line says
    how long the step has run, so that every phase shows it is moving. A failure raises with the
    output's last lines."""
    start, tail = time.monotonic(), collections.deque[str](maxlen=15)
    text = codecs.getincrementaldecoder("utf-8")(errors="replace")
    with subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as child:
        assert child.stdout is not None
        out, line = child.stdout.fileno(), ""
        while True:
            if not select.select([out], [], [], quiet_after)[0]:
                _log.info(f"{what}: {time.monotonic() - start:.0f} s so far")
                continue
            chunk = os.read(out, 1 << 16)
            if not chunk:
                break
            shown = text.decode(chunk)
            sys.stderr.write(shown)
            sys.stderr.flush()
            *done, line = (line + shown).replace("\r", "\n").split("\n")
            tail.extend(d for d in done if d.strip())
        returncode = child.wait()
    if returncode != 0:
        lines = "\n".join([*tail, line] if line.strip() else tail)
        raise PrepareError(f"{what} failed (exit {returncode}):\n{lines}")


def dequantize_gguf(gguf: Path, out_dir: Path) -> None:
    """GGUF -> Hugging Face folder (fp16 safetensors + tokenizer), in a child process."""
    run_child(
        [sys.executable, "-m", "engine.prepare.convert", "dequantize", str(gguf), str(out_dir)],
        f"dequantizing {gguf.name}",
    )


def export_ir(hf_folder: str, out_dir: Path, compression: Compression) -> None:
    """Hugging Face folder (or hub id) -> stateful OpenVINO IR with OpenVINO tokenizers."""
    cmd = [
        sys.executable,
        "-m",
        "engine.prepare.convert",
        "export",
        "openvino",
        "--model",
        hf_folder,
        "--task",
        "text-generation-with-past",
        *compression.cli_args(),
        str(out_dir),
    ]
    run_child(cmd, f"exporting {hf_folder} to OpenVINO ({compression.precision})")


def write_tokenizer(gguf: Path, out_dir: Path) -> None:
    """``gguf``'s tokenizer as Hugging Face files (tokenizer.json, tokenizer_config.json, its chat
    template), as the dequantization writes them, in a child process: transformers reads the
    file's metadata, never its tensors."""
    run_child(
        [sys.executable, "-m", "engine.prepare.convert", "tokenizer", str(gguf), str(out_dir)],
        f"reading {gguf.name}'s tokenizer",
    )


def keep_gguf_blocks(ir: Path, gguf: Path) -> None:
    """Put ``gguf``'s own quantized blocks back into the fp16 IR exported from it, in a child process."""
    run_child(
        [sys.executable, "-m", "engine.prepare.convert", "blocks", str(ir), str(gguf)],
        f"keeping {gguf.name}'s quantized blocks",
    )


def _dequantize_main(gguf: Path, out_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    print(f"dequantizing {gguf.name} (transformers GGUF loader)", file=sys.stderr, flush=True)
    tokenizer = auto_tokenizer(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float16)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _tokenizer_main(gguf: Path, out_dir: Path) -> None:
    auto_tokenizer(gguf.parent, gguf_file=gguf.name).save_pretrained(out_dir)


def _export_main(args: list[str]) -> None:
    """optimum-cli with the given arguments, in this process."""
    from optimum.commands.optimum_cli import main as optimum_cli

    sys.argv = ["optimum-cli", *args]
    optimum_cli()


if __name__ == "__main__":
    hide_unloadable_torchvision()
    gguf_file.everywhere()
    if len(sys.argv) == 4 and sys.argv[1] == "dequantize":
        _dequantize_main(Path(sys.argv[2]), Path(sys.argv[3]))
    elif len(sys.argv) == 4 and sys.argv[1] == "tokenizer":
        _tokenizer_main(Path(sys.argv[2]), Path(sys.argv[3]))
    elif len(sys.argv) == 4 and sys.argv[1] == "blocks":
        from engine.prepare.gguf_blocks import rewrite_ir

        rewrite_ir(Path(sys.argv[2]), Path(sys.argv[3]))
    elif len(sys.argv) > 2 and sys.argv[1] == "export":
        _export_main(sys.argv[1:])
    else:
        sys.exit(
            "usage: python -m engine.prepare.convert dequantize GGUF OUT_DIR | tokenizer GGUF OUT_DIR"
            " | blocks IR_DIR GGUF | export openvino ARGS..."
        )

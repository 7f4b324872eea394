"""Get a target and a draft model onto disk as ready OpenVINO IR folders.

``python -m engine.prepare`` builds the embedded default pair; ``--target`` /
``--draft`` take any source that :mod:`engine.prepare.sources` recognises. A GGUF whose model
:mod:`engine.prepare.gguf_graph` builds, kept in its blocks or in 4 bits, has its graph built
straight from the file; any other source is exported by optimum-intel (a GGUF dequantized by
transformers first) and compressed by NNCF. Results are cached by source identity and
compression settings; every cache entry is built in a temporary folder and renamed into place
only when complete.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from importlib import metadata
from pathlib import Path

from engine.errors import PrepareError, TokenizerMismatchError
from engine.manifest import MANIFEST, read
from engine.prepare import disk, embedded, gguf_graph, sources, vocab
from engine.prepare.convert import (
    PRECISIONS,
    Compression,
    dequantize_gguf,
    export_ir,
    keep_gguf_blocks,
    write_tokenizer,
)
from engine.prepare.gguf_file import open_gguf
from engine.prepare.phases import phase
from engine.prepare.sources import Kind, Source

CACHE_ENV = "SPECCHAT_CACHE"
# The target answers as the model in the file: a GGUF keeps its own blocks, any other source gets
# int8, which agrees with its model on the next token where data-free int4 does not
# (docs/benchmarks.md, "Faithful to the file"). The draft's rounding changes only how many drafts
# land, never the answer, so it stays as cheap as int4 makes it.
DEFAULT_PRECISION = {"target": "gguf", "draft": "int4"}
# What "gguf" becomes for a source that has no blocks of its own to keep.
WITHOUT_BLOCKS = "int8"
# A Hugging Face Space's persistent storage, when the Space has it: prepared models outlive restarts.
PERSISTENT_STORAGE = Path("/data")
# What a manifest's "graph" says of a model exported by optimum-intel (gguf_graph.FROM_FILE: built
# from its GGUF).
EXPORTED = "optimum-intel"


def default_cache_dir() -> Path:
    """$SPECCHAT_CACHE, else /data/specchat where a writable /data exists (a Space), else ~/.cache/specchat."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    if PERSISTENT_STORAGE.is_dir() and os.access(PERSISTENT_STORAGE, os.W_OK):
        return PERSISTENT_STORAGE / "specchat"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "specchat"


@dataclass(frozen=True)
class PreparedModel:
    path: Path
    precision: str
    source: str
    sha256: str

    def as_dict(self) -> dict:
        return {**asdict(self), "path": str(self.path)}


def log(message: str) -> None:
    """A line of progress: on stderr, and to whoever listens to the ``specchat.prepare`` log (the
    app's page while it starts)."""
    _logger.info(message)


def _stderr_logger() -> logging.Logger:
    logger = logging.getLogger("specchat.prepare")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[prepare] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False  # printed once, whatever the app's own logging does
    return logger


_logger = _stderr_logger()


def library_versions() -> dict[str, str]:
    names = ("openvino", "openvino-tokenizers", "optimum-intel", "nncf", "transformers")
    return {n: metadata.version(n) for n in names}


def _identity(source: Source) -> str:
    """A stable id of the source's content, cheap enough for the cache check."""
    if source.kind == Kind.EMBEDDED:
        return embedded.EMBEDDED[source.spec].sha256
    if source.kind == Kind.GGUF:
        st = source.local.stat()
        return hashlib.sha256(f"{source.path}:{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()
    if source.kind == Kind.HF_FOLDER:
        return sources.folder_fingerprint(source.local)
    return hashlib.sha256(source.spec.encode()).hexdigest()


def entry_dir(cache_dir: Path, source: Source, compression: Compression) -> Path:
    key = json.dumps({"id": _identity(source), **compression.as_dict()}, sort_keys=True)
    slug = "".join(c if c.isalnum() or c in "._-" else "-" for c in source.label.removesuffix(".gguf"))
    return cache_dir / "ir" / f"{slug}-{compression.precision}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def cached(entry: Path) -> PreparedModel | None:
    data = read(entry)
    if data is None:
        return None
    return PreparedModel(entry, data["precision"], data["source"], data["sha256"])


def local_source(source: Source, cache_dir: Path) -> Source:
    """Embedded and hub sources become a local GGUF file or HF folder."""
    if source.kind == Kind.EMBEDDED:
        with phase("download"):
            path = embedded.fetch(embedded.EMBEDDED[source.spec], cache_dir, log)
        return Source(source.spec, Kind.GGUF, path)
    if source.kind == Kind.HUB:
        with phase("download"):
            return Source(source.spec, Kind.HF_FOLDER, download_from_hub(source.spec, cache_dir))
    return source


def download_from_hub(repo_id: str, cache_dir: Path) -> Path:
    """The real hub path: fails fast with one message where the hub is unreachable."""
    if sources.hub_offline():
        raise PrepareError(f"{repo_id}: HF_HUB_OFFLINE is set, so the model hub cannot be used")
    import requests

    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    try:
        requests.head(endpoint, timeout=5)
    except requests.RequestException as exc:
        raise PrepareError(
            f"{repo_id}: the model hub ({endpoint}) is not reachable from this machine ({type(exc).__name__}). "
            f"Use the embedded default, a local GGUF file, a Hugging Face folder or an OpenVINO IR folder."
        ) from None
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(
                repo_id,
                cache_dir=cache_dir / "hub",
                allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"],
            )
        )
    except Exception as exc:  # huggingface_hub raises many types; the message is what matters
        raise PrepareError(f"{repo_id}: download from the model hub failed: {exc}") from exc


def _source_sha256(source: Source) -> str:
    if source.kind == Kind.EMBEDDED:
        return embedded.EMBEDDED[source.spec].sha256
    if source.kind == Kind.GGUF:
        return embedded.sha256_file(source.local, desc=f"sha256 {source.local.name}")
    return sources.folder_fingerprint(source.local)


def _conversion_bytes(source: Source) -> int:
    """Disk a conversion needs on the way: the fp16 intermediate and the IR."""
    if source.kind == Kind.EMBEDDED:
        return embedded.EMBEDDED[source.spec].size * 6
    if source.kind == Kind.GGUF:
        return source.local.stat().st_size * 4
    if source.kind == Kind.HF_FOLDER:
        return sum(p.stat().st_size for p in source.local.rglob("*") if p.is_file()) * 2
    return 8 << 30


def _check_architecture(source: Source) -> None:
    if source.kind == Kind.GGUF:
        sources.check_architecture(vocab.gguf_architecture(source.local), source.spec)
    elif source.kind == Kind.HF_FOLDER:
        sources.check_architecture(sources.hf_model_type(source.local), source.spec)


def for_source(compression: Compression, source: Source) -> Compression:
    """``gguf`` keeps a GGUF's own blocks; a source without blocks gets :data:`WITHOUT_BLOCKS`."""
    if compression.precision != "gguf" or source.kind in (Kind.GGUF, Kind.EMBEDDED):
        return compression
    return replace(compression, precision=WITHOUT_BLOCKS)


def prepare_one(spec: str, compression: Compression, cache_dir: Path) -> PreparedModel:
    """Return the IR folder for ``spec``, converting it only if no cache entry exists."""
    source = sources.resolve(spec)
    if source.kind == Kind.OV_IR:
        return PreparedModel(source.local, "as-is", spec, sources.folder_fingerprint(source.local))
    if (kept := for_source(compression, source)) != compression:
        log(f"{spec}: not a GGUF file, so no quantized blocks of its own to keep: weights {kept.precision}")
        compression = kept
    entry = entry_dir(cache_dir, source, compression)
    if hit := cached(entry):
        log(f"{spec}: already prepared ({hit.precision}) at {entry}")
        return hit
    disk.require_free(cache_dir, _conversion_bytes(source), f"convert {spec}")
    start = time.perf_counter()
    with disk.exclusive(entry.parent, entry.name, log) as scratch:
        if hit := cached(entry):  # another preparation finished it while this one waited
            return hit
        with disk.full_disk_reported(entry.parent, f"convert {spec}"):
            sha = _build(spec, source, compression, cache_dir, scratch)
            os.replace(scratch / "ir", entry)
    log(f"{spec}: ready at {entry} ({time.perf_counter() - start:.0f} s)")
    return PreparedModel(entry, compression.precision, spec, sha)


def _build(spec: str, source: Source, compression: Compression, cache_dir: Path, scratch: Path) -> str:
    """Convert ``source`` into ``scratch / "ir"`` with its manifest; return the source's sha256."""
    start = time.perf_counter()
    local = local_source(source, cache_dir)
    _check_architecture(local)
    sha = _source_sha256(source if source.kind == Kind.EMBEDDED else local)
    build = scratch / "ir"
    if builds_from_file(spec, local, compression):
        graph = gguf_graph.FROM_FILE
        _from_file(spec, local, compression, build)
    else:
        graph = EXPORTED
        with phase("graph"):
            _export(spec, local, compression, scratch, build)
    vocabulary = vocab.Vocabulary.of(Source(spec, Kind.OV_IR, build))
    sources.validate_ir(build)
    manifest = {
        "source": spec,
        "kind": source.kind.value,
        "sha256": sha,
        "precision": compression.precision,
        "compression": compression.as_dict(),
        "graph": graph,
        "versions": library_versions(),
        "seconds": round(time.perf_counter() - start, 1),
        "vocabulary": asdict(vocabulary),
    }
    (build / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return sha


def builds_from_file(spec: str, local: Source, compression: Compression) -> bool:
    """Whether ``local`` is prepared by building its graph from the file (engine.prepare.gguf_graph):
    a GGUF of a model those graphs build, in its own blocks (``gguf``) or in 4 bits (``int4``: the
    file's Q4_K and Q4_0 rows, the rest requantized to Q4_0, whose groups of 32 are finer than any
    ``--group-size``; ``--ratio`` below 1 and ``--asym`` are NNCF's, so they go through the export,
    as int8 and fp16 do). Says why not where a GGUF cannot be."""
    if local.kind != Kind.GGUF or compression.precision not in ("gguf", "int4"):
        return False
    if compression.precision == "int4" and (compression.ratio < 1.0 or not compression.sym):
        log(f"{spec}: int4 with NNCF's settings (ratio {compression.ratio}, symmetric {compression.sym})")
        return False
    try:
        gguf_graph.shape_of(open_gguf(local.local), spec)
    except gguf_graph.UnsupportedModel as exc:
        log(f"{exc}: prepared through transformers and optimum-intel instead")
        return False
    return True


def _from_file(spec: str, local: Source, compression: Compression, build: Path) -> None:
    """The plugin's graph built from the GGUF (its graph on ggml's kernels is built from it too,
    on first use: engine.prepare.ggml_ir) and its tokenizer read from the file."""
    four_bit = compression.precision == "int4"
    weights = "in 4-bit blocks" if four_bit else "in the file's own blocks"
    log(f"{spec}: building its graph from the file, weights {weights}")
    with phase("graph"):
        gguf_graph.write(local.local, build, four_bit=four_bit, log=log)
    log(f"{spec}: reading its tokenizer from the file (transformers)")
    with phase("tokenizer"):
        write_tokenizer(local.local, build)


def _export(spec: str, local: Source, compression: Compression, scratch: Path, build: Path) -> None:
    """The IR exported by optimum-intel from a Hugging Face folder (a GGUF dequantized to one first),
    its weights compressed by NNCF, or a GGUF's own blocks put back."""
    if local.kind == Kind.GGUF:
        disk.require_free(scratch.parent, _conversion_bytes(local), f"dequantize {spec}")
        log(f"{spec}: dequantizing GGUF to a temporary fp16 folder")
        hf = scratch / "hf"
        dequantize_gguf(local.local, hf)
    else:
        hf = local.local
    disk.require_free(scratch.parent, _conversion_bytes(Source(spec, Kind.HF_FOLDER, hf)) // 2, f"export {spec}")
    if compression.precision == "gguf":
        log(f"{spec}: exporting to OpenVINO IR (fp16), then putting the file's quantized blocks back")
        export_ir(str(hf), build, compression)
        keep_gguf_blocks(build, local.local)
    else:
        log(f"{spec}: exporting to OpenVINO IR, weights {compression.precision} (NNCF)")
        export_ir(str(hf), build, compression)


def _is_prepared(spec: str, compression: Compression, cache_dir: Path) -> bool:
    source = sources.resolve(spec)
    if source.kind == Kind.OV_IR:
        return True
    return cached(entry_dir(cache_dir, source, for_source(compression, source))) is not None


def check_pair(target: str, draft: str, vocabularies: tuple[vocab.Vocabulary, vocab.Vocabulary]) -> None:
    """Refuse a draft whose tokenizer differs from the target's."""
    t, d = vocabularies
    if t.digest != d.digest:
        raise TokenizerMismatchError(
            f"the draft {draft} ({d.describe()}) does not share the tokenizer of the target {target} "
            f"({t.describe()}): speculative decoding needs one vocabulary. Pick a draft of the same model family."
        )


def ir_vocabulary(model: PreparedModel) -> vocab.Vocabulary:
    """The prepared model's vocabulary: recorded in its manifest, else read from its tokenizer."""
    recorded = (read(model.path) or {}).get("vocabulary")
    return (
        vocab.Vocabulary(**recorded) if recorded else vocab.Vocabulary.of(Source(model.source, Kind.OV_IR, model.path))
    )


def prepare_pair(
    target: str, draft: str, target_compression: Compression, draft_compression: Compression, cache_dir: Path
) -> tuple[PreparedModel, PreparedModel]:
    """Both models as IR folders; a draft of another vocabulary is refused before any conversion."""
    start = time.perf_counter()
    disk.remove_stale(cache_dir, log)
    if not all(_is_prepared(s, c, cache_dir) for s, c in ((target, target_compression), (draft, draft_compression))):
        check_pair(target, draft, (source_vocabulary(target, cache_dir), source_vocabulary(draft, cache_dir)))
    pair = (prepare_one(target, target_compression, cache_dir), prepare_one(draft, draft_compression, cache_dir))
    check_pair(target, draft, (ir_vocabulary(pair[0]), ir_vocabulary(pair[1])))
    log(f"done in {time.perf_counter() - start:.1f} s")
    return pair


def source_vocabulary(spec: str, cache_dir: Path) -> vocab.Vocabulary:
    return vocab.Vocabulary.of(local_source(sources.resolve(spec), cache_dir))


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model flags shared by prepare, bench and the app."""
    parser.add_argument(
        "--target",
        default=os.environ.get("SPECCHAT_TARGET", embedded.DEFAULT_TARGET),
        help="target model: embedded name, GGUF file, HF folder, hub id or OpenVINO IR folder",
    )
    parser.add_argument(
        "--draft",
        default=os.environ.get("SPECCHAT_DRAFT", embedded.DEFAULT_DRAFT),
        help="draft model, same tokenizer as the target (default: $SPECCHAT_DRAFT or the embedded one)",
    )
    for role in ("target", "draft"):
        variable = f"SPECCHAT_{role.upper()}_PRECISION"
        parser.add_argument(
            f"--{role}-precision",
            default=os.environ.get(variable, DEFAULT_PRECISION[role]),
            choices=PRECISIONS,
            help=f"weights of the {role}; gguf keeps a GGUF's own quantized blocks ({WITHOUT_BLOCKS} for other "
            f"sources) (default: ${variable} or {DEFAULT_PRECISION[role]})",
        )
    parser.add_argument("--group-size", type=int, default=128, help="int4 group size")
    parser.add_argument("--ratio", type=float, default=1.0, help="share of layers in int4 (rest int8)")
    parser.add_argument(
        "--all-layers",
        action="store_true",
        help="compress the target's embeddings and lm_head to int4 too (the draft's always are)",
    )
    parser.add_argument(
        "--asym",
        dest="sym",
        action="store_false",
        help="asymmetric int4/int8 weights, with zero points (default symmetric)",
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help=f"default: ${CACHE_ENV}, else /data/specchat where /data is writable (a Space), else ~/.cache/specchat",
    )


def draft_compression(
    precision: str = "int4", group_size: int = 128, ratio: float = 1.0, sym: bool = True
) -> Compression:
    """The draft's embeddings and vocabulary projection go to int4 with its layers: the draft's
    rounding cannot change the output, and the int4 head makes a draft step about a quarter
    cheaper on this CPU (docs/benchmarks.md, "Tried and dropped"). Only int4 has that option, so other precisions
    keep the plain settings (and the same cache entry)."""
    return Compression(precision, group_size, ratio, all_layers=precision == "int4", sym=sym)


def default_compressions() -> dict[str, Compression]:
    """What ``python -m engine.prepare`` without flags builds, by role."""
    return {"target": Compression(DEFAULT_PRECISION["target"]), "draft": draft_compression(DEFAULT_PRECISION["draft"])}


def compression_from_args(args: argparse.Namespace, role: str, precision: str) -> Compression:
    """The compression the flags ask for, for the ``target`` or the ``draft``."""
    if role == "draft":
        return draft_compression(precision, args.group_size, args.ratio, args.sym)
    return Compression(precision, args.group_size, args.ratio, args.all_layers, args.sym)


def cache_dir_from_args(args: argparse.Namespace) -> Path:
    return args.cache_dir or default_cache_dir()


def prepare_from_args(args: argparse.Namespace) -> tuple[PreparedModel, PreparedModel]:
    cache_dir = cache_dir_from_args(args)
    return prepare_pair(
        args.target,
        args.draft,
        compression_from_args(args, "target", args.target_precision),
        compression_from_args(args, "draft", args.draft_precision),
        cache_dir,
    )

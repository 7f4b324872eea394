"""Write an unquantized (f32) GGUF file from a tiny Hugging Face causal LM folder.

Test helper: lets tests build GGUF fixtures without llama.cpp or network. The layout
follows llama.cpp's ``convert_hf_to_gguf.py`` closely enough that transformers'
GGUF loader (``from_pretrained(..., gguf_file=...)``) reads it back into the same
model and tokenizer. Supports ``model_type`` "qwen2" and "llama" with a byte-level
BPE tokenizer (``tokenizer.json`` with vocab + merges).

Run ``python tests/gguf_writer.py`` for a round-trip self-check.

Loader quirks (transformers 5.5) worth knowing when asserting on the reloaded tokenizer:
- the pre-tokenizer is not stored in GGUF; transformers rebuilds it from the architecture
  (qwen2: Qwen2 split regex + NFC; llama: GPT-2 ByteLevel regex), so a source tokenizer
  with another pre-tokenizer would tokenize differently after the round trip;
- ``tokenizer.ggml.eos_token_id`` is not honoured: qwen2 gets Qwen2Tokenizer's default
  ``<|endoftext|>``, llama gets the bos token as eos (the converter swaps/reuses bos);
- llama GGUFs load as CodeLlamaTokenizer, which always prepends bos and appends five
  FIM tokens (``▁<PRE>`` ...) beyond the model's vocabulary;
- keep the GGUF in a folder without ``tokenizer_config.json``/``tokenizer.json``: AutoTokenizer
  would otherwise build the tokenizer from those files instead of the GGUF.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig

from tests.tiny import TINY_SHAPE

ARCHES = {"qwen2": gguf.MODEL_ARCH.QWEN2, "llama": gguf.MODEL_ARCH.LLAMA}
# tokenizer.ggml.pre values llama.cpp uses for these families (transformers ignores it:
# it picks the pre-tokenizer from the architecture, see the module docstring).
PRE_TOKENIZER = {"qwen2": "qwen2", "llama": "llama-bpe"}


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter permutation for llama Q/K rows (rotate-half -> interleaved rope).

    transformers' LlamaTensorProcessor undoes exactly this when loading a "llama" GGUF.
    """
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rope_theta(config: PretrainedConfig) -> float:
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise NotImplementedError(f"rope scaling is not supported: {rope}")
    return float(rope.get("rope_theta") or getattr(config, "rope_theta", 10000.0))


def _tokenizer_fields(hf_folder: Path, vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """Tokens (by id, padded to the model's vocab size like llama.cpp), token types and merges."""
    data = json.loads((hf_folder / "tokenizer.json").read_text(encoding="utf-8"))
    model = data["model"]
    if model["type"] != "BPE":
        raise NotImplementedError(f"only BPE tokenizers are supported, got {model['type']}")
    by_id: dict[int, tuple[str, int]] = {i: (t, gguf.TokenType.NORMAL) for t, i in model["vocab"].items()}
    for added in data.get("added_tokens", []):
        kind = gguf.TokenType.CONTROL if added["special"] else gguf.TokenType.USER_DEFINED
        by_id[added["id"]] = (added["content"], kind)
    size = max(vocab_size, max(by_id) + 1)
    tokens = [by_id.get(i, (f"[PAD{i}]", gguf.TokenType.UNUSED))[0] for i in range(size)]
    types = [int(by_id.get(i, (None, gguf.TokenType.UNUSED))[1]) for i in range(size)]
    # tokenizers >= 0.20 saves merges as pairs, older versions as "a b" strings; byte-level
    # tokens never contain a real space, so joining with one is unambiguous.
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, types, merges


def write_gguf(
    hf_folder: Path, out_path: Path, quantization: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32
) -> Path:
    """Write ``hf_folder`` (model + byte-level BPE tokenizer) to ``out_path`` as a GGUF: every
    matrix in ``quantization`` (one gguf-py can quantize, such as Q8_0 or Q4_0), the rest f32.

    ``output.weight`` is always written, so the loaded model has
    ``tie_word_embeddings=False`` even when the source model was tied.
    """
    hf_folder, out_path = Path(hf_folder), Path(out_path)
    config = AutoConfig.from_pretrained(hf_folder)
    if config.model_type not in ARCHES:
        raise NotImplementedError(f"model_type {config.model_type!r} is not supported")
    arch = config.model_type
    model = AutoModelForCausalLM.from_pretrained(hf_folder, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(hf_folder)

    n_head, n_kv = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_head
    writer = gguf.GGUFWriter(out_path, gguf.MODEL_ARCH_NAMES[ARCHES[arch]])
    writer.add_name(hf_folder.name)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_vocab_size(config.vocab_size)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_dimension_count(head_dim)  # transformers reads it as head_dim for llama
    writer.add_rope_freq_base(_rope_theta(config))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)

    tokens, types, merges = _tokenizer_fields(hf_folder, config.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(PRE_TOKENIZER[arch])
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    # Like llama.cpp, fall back to config.json for ids the tokenizer does not define (Qwen
    # has no bos token but config.bos_token_id = <|endoftext|>). transformers' llama GGUF
    # tokenizer indexes tokens[bos_token_id] whenever an eos id exists, so bos is needed.
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else config.bos_token_id
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else config.eos_token_id
    if isinstance(eos, list):
        eos = eos[0]
    for add, token_id in (
        (writer.add_bos_token_id, bos),
        (writer.add_eos_token_id, eos),
        (writer.add_pad_token_id, tokenizer.pad_token_id),
    ):
        if token_id is not None:
            add(int(token_id))
    # Without this key transformers' llama GGUF tokenizer assumes a sentencepiece-style
    # prefix space and strips the first space of every decoded text.
    writer.add_add_space_prefix(False)
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)

    name_map = gguf.get_tensor_name_map(ARCHES[arch], config.num_hidden_layers)
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
    for hf_name, array in state.items():
        if hf_name.endswith("rotary_emb.inv_freq"):
            continue
        name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"cannot map tensor {hf_name!r} to a GGUF name")
        if arch == "llama" and ".attn_q." in name:
            array = permute_qk(array, n_head)
        elif arch == "llama" and ".attn_k." in name:
            array = permute_qk(array, n_kv)
        # gguf-py reverses numpy's shape into ggml's ne order itself, like convert_hf_to_gguf.
        array = np.ascontiguousarray(array, dtype=np.float32)
        if array.ndim == 2 and quantization != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, gguf.quants.quantize(array, quantization), raw_dtype=quantization)
        else:
            writer.add_tensor(name, array)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


# --------------------------------------------------------------------------- self-check

_CORPUS = [
    "Hello, world! This is a tiny corpus for a tiny tokenizer.",
    "héllo wörld, ça va? Größe, naïve café, façade, señor, jalapeño.",
    "日本語のテキストです。日本 東京 大阪 こんにちは 世界",
    "Emoji: 🙂 🚀 🎉 👍 and math: ∑ ∫ √ π ≈ 3.14159",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n",
    "Привет, мир! Как дела? Ελληνικά κείμενα. العربية",
    "The quick brown fox jumps over the lazy dog 0123456789.",
]
_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _make_tokenizer(arch: str, folder: Path) -> None:
    """Train a byte-level BPE whose pre-tokenizer matches what transformers rebuilds for ``arch``."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    if arch == "qwen2":
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(_CORPUS * 4, trainer)
    tok.add_special_tokens(_SPECIALS)  # appended after the BPE vocab, as in Qwen
    if arch == "llama":  # llama tokenizers prepend BOS, and transformers' llama GGUF tokenizer always does
        tok.post_processor = processors.TemplateProcessing(
            single="<|endoftext|> $A",
            pair="<|endoftext|> $A <|endoftext|> $B",
            special_tokens=[("<|endoftext|>", tok.token_to_id("<|endoftext|>"))],
        )
    PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=_CHAT_TEMPLATE,
    ).save_pretrained(folder)


def _make_model(arch: str, folder: Path, vocab_size: int, tied: bool) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}[arch]
    config = config_cls(
        **TINY_SHAPE,
        vocab_size=vocab_size,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_theta=50000.0,
        tie_word_embeddings=tied,
        bos_token_id=vocab_size - 3,
        eos_token_id=vocab_size - 1,
    )
    torch.manual_seed(0)
    model = model_cls(config).eval()
    with torch.no_grad():  # default init leaves biases at 0 and norms at 1: randomize everything
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    model.save_pretrained(folder)


def _self_check() -> None:
    import tempfile
    import time

    texts = [
        "héllo 日本 🙂",
        "Hello, world! 123 don't",
        "  spaces\n\nand\ttabs ",
        "<|im_start|>user\nCafé?<|im_end|>\n",
        "Привет 🚀 ∑",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for arch, tied in (("qwen2", False), ("llama", False), ("llama", True)):
            start = time.perf_counter()
            hf, out = Path(tmp, f"{arch}-hf"), Path(tmp, f"{arch}-{tied}-gguf", "model.gguf")
            out.parent.mkdir()
            _make_tokenizer(arch, hf)
            ref_tok = AutoTokenizer.from_pretrained(hf)
            _make_model(arch, hf, len(ref_tok), tied)
            write_gguf(hf, out)

            tok = AutoTokenizer.from_pretrained(out.parent, gguf_file=out.name)
            for text in texts:
                ref_ids, ids = ref_tok.encode(text), tok.encode(text)
                assert ids == ref_ids, (arch, text, ref_ids, ids)
                decoded = tok.decode(ids, skip_special_tokens=True)
                assert decoded == ref_tok.decode(ref_ids, skip_special_tokens=True), (arch, text, decoded)
            assert tok.chat_template == ref_tok.chat_template

            ref = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
            got = AutoModelForCausalLM.from_pretrained(out.parent, gguf_file=out.name, dtype=torch.float32).eval()
            assert got.config.model_type == arch and not got.config.tie_word_embeddings
            chat = ref_tok.apply_chat_template(
                [{"role": "user", "content": " ".join(texts)}], tokenize=False, add_generation_prompt=True
            )
            ids = torch.tensor([ref_tok.encode(chat)])
            with torch.no_grad():
                diff = (ref(ids).logits - got(ids).logits).abs().max().item()
            assert diff < 1e-4, (arch, diff)
            # eos is informational: transformers does not take it from the GGUF (module docstring).
            print(
                f"{arch} (tied={tied}): {ids.shape[1]} tokens, max |dlogits| = {diff:.2e}, "
                f"{type(tok).__name__} eos={tok.eos_token} (source eos={ref_tok.eos_token}), "
                f"{time.perf_counter() - start:.1f}s"
            )
    print("gguf_writer self-check passed")


if __name__ == "__main__":
    _self_check()

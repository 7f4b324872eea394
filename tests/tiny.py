"""Tiny random models of the real architectures, with a tiny byte-level BPE tokenizer.

They go through the same preparation path as real models; their small vocabulary
keeps exports fast and makes sampling distributions testable.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# The shape every tiny model shares: 2 layers, hidden 64, grouped-query attention.
TINY_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i)\n",
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts tokens and verifies them in one pass.",
    "héllo wörld, ça va? naïve café",
    "日本語のテキスト 中文 한국어",
    "emoji 🙂 🚀 ✨",
    "class Stack:\n    def push(self, x):\n        self.items.append(x)\n",
]


def build_tokenizer(folder: Path, vocab_size: int = 400, extra_corpus: tuple[str, ...] = ()):
    """Train a byte-level BPE tokenizer (multi-byte characters span several tokens) and save it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 20 + list(extra_corpus), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None, unk_token=None
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return fast


def build_model(
    folder: Path,
    tokenizer_folder: Path,
    arch: str = "qwen2",
    seed: int = 0,
    base: Path | None = None,
    noise: float = 0.0,
    max_positions: int = 256,
) -> Path:
    """A random model of ``arch``; with ``base``, a copy of that model plus Gaussian noise
    (a draft that agrees with its target often, but not always)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, Qwen2Config

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
    torch.manual_seed(seed)
    if base is not None:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(noise * p.std() * torch.randn_like(p))
    else:
        config_cls = {"qwen2": Qwen2Config, "llama": LlamaConfig}[arch]
        config = config_cls(
            **TINY_SHAPE,
            vocab_size=len(tokenizer),
            max_position_embeddings=max_positions,
            tie_word_embeddings=False,
            initializer_range=0.3,
            eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=None,
        )
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = model.config.eos_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


TOKENS = [5, 17, 42, 99, 150, 3, 77, 200, 11, 64]


def ov_logits(ir: Path, tokens: list[int]) -> np.ndarray:
    """Every row's logits of ``tokens`` in one exact (f32) pass over an empty cache."""
    from engine.core.runtime import EXACT_CONFIG, Runtime

    return Runtime(ir, config=EXACT_CONFIG).forward(tokens, rows=len(tokens))

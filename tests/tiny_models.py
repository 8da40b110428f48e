"""Tiny random HF models and a local word-level tokenizer with a chat template (no downloads)."""
from __future__ import annotations

import json
import os

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}<|im_start|>assistant\n"
    "{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

SPECIAL = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]


def build_tokenizer(out_dir: str, vocab_size: int):
    """A word-level tokenizer with digits, letters, punctuation and filler words, padded to
    `vocab_size` entries; saved to `out_dir` as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    words = list(SPECIAL) + ["\n", "user", "assistant", "system"]
    words += [str(d) for d in range(10)] + list("abcdefghijklmnopqrstuvwxyz")
    words += list("+-*/=?.,:;!()") + ["\\boxed{", "}", "what", "is", "the", "answer", "sum",
                                       "of", "and", "plus", "copy", "repeat"]
    i = 0
    while len(words) < vocab_size:
        words.append(f"w{i}")
        i += 1
    vocab = {w: idx for idx, w in enumerate(words[:vocab_size])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split("\n", behavior="isolated"),
        pre_tokenizers.WhitespaceSplit(),
        pre_tokenizers.Split(pattern=__import__("tokenizers").Regex(r"\d"), behavior="isolated"),
        pre_tokenizers.Punctuation(behavior="isolated"),
    ])
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                   eos_token="<|im_end|>", bos_token=None)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


ARCH_DEFAULTS = {
    "qwen3": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], tie_word_embeddings=True,
                  head_dim=16),
    "llama": dict(model_type="llama", architectures=["LlamaForCausalLM"],
                  tie_word_embeddings=False),
    "qwen2": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"],
                  tie_word_embeddings=False),
}


def build_tiny_model(out_dir: str, arch: str = "qwen3", vocab_size: int = 200, hidden: int = 64,
                     layers: int = 4, heads: int = 8, kv_heads: int = 2, intermediate: int = 128,
                     seed: int = 0, tokenizer: bool = True, **extra) -> str:
    """Save a random tiny HF model (fp32 safetensors) and tokenizer to `out_dir`; return it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    os.makedirs(out_dir, exist_ok=True)
    cfg = dict(ARCH_DEFAULTS[arch])
    model_type = cfg.pop("model_type")
    cfg.update(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
               num_attention_heads=heads, num_key_value_heads=kv_heads,
               intermediate_size=intermediate, max_position_embeddings=512, rms_norm_eps=1e-6,
               rope_theta=10000.0, torch_dtype="float32", pad_token_id=0, eos_token_id=3,
               bos_token_id=None)
    cfg.update(extra)
    config = AutoConfig.for_model(model_type, **cfg)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():  # non-trivial norms so a mis-mapped norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(out_dir, safe_serialization=True)
    if tokenizer:
        build_tokenizer(out_dir, vocab_size)
    return out_dir

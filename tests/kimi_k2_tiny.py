"""Tiny Kimi-K2 folders laid out as Moonshot publishes Kimi-K2-Instruct (no downloads).

`build_kimi_k2`: the tiny DeepSeek-V3 of tests/deepseek_v3_tiny.py (2 layers: one dense, one
MoE; MLA with q_lora_rank 32; 8 experts, top-4, a random score-correction bias) with Kimi-K2's
values where they differ from DeepSeek-V3's: no expert groups (n_group = topk_group = 1),
routed_scaling_factor 2.827, no MTP layer, rope_theta 50000, YaRN factor 32 with beta_fast =
beta_slow = 1.0, mscale = mscale_all_dim = 1.0, original_max_position_embeddings 4096,
max_position_embeddings 131072. Its config.json is rewritten as Kimi-K2-Instruct's is written:
the same keys in the same (sorted) order, model_type "kimi_k2", legacy `rope_scaling` and
top-level `rope_theta`, `auto_map` to configuration_deepseek.py / modeling_deepseek.py (present as
stand-in files that are never executed), aux_loss_alpha, seq_aux, transformers_version 4.48.3.
The tokenizer is the tests' word-level one (tools/tiny_models.py).

`with_custom_tokenizer`: a copy whose tokenizer is the folder's own code as Kimi-K2's is:
tokenizer_config.json names `TikTokenTokenizer` with `auto_map.AutoTokenizer` ->
tokenization_kimi.TikTokenTokenizer, the vocabulary is in `tiktoken.model` (no tokenizer.json),
and tokenization_kimi.py is a stand-in class (a fast tokenizer reading tiktoken.model as a
tokenizers JSON file: the same ids as the word-level tokenizer) that only trust_remote_code runs.
"""
from __future__ import annotations

import json
import os
import shutil

from tests.deepseek_v3_tiny import build_deepseek_v3

KIMI = dict(n_group=1, topk_group=1, routed_scaling_factor=2.827, first_k_dense_replace=1,
            max_position_embeddings=131072, rms_norm_eps=1e-6,
            rope_parameters=dict(rope_type="yarn", rope_theta=50000.0, factor=32.0,
                                 beta_fast=1.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
                                 original_max_position_embeddings=4096))
AUTO_MAP = {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
            "AutoModel": "modeling_deepseek.DeepseekV3Model",
            "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"}
# the keys of Kimi-K2-Instruct's config.json taken from the saved transformers config
SHAPE_KEYS = ("hidden_size", "initializer_range", "intermediate_size", "kv_lora_rank",
              "moe_intermediate_size", "n_routed_experts", "n_shared_experts",
              "num_attention_heads", "num_experts_per_tok", "num_hidden_layers",
              "num_key_value_heads", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
              "v_head_dim", "vocab_size")
STAND_IN = "# stand-in for Moonshot's {name}: never executed (models.families.deepseek_v3.kimi_k2_hf)\n"
TOKENIZER_CODE = '''"""Stand-in for Kimi-K2's tokenization_kimi.py (tests/kimi_k2_tiny.py): its
vocabulary file is tiktoken.model, a tokenizers JSON file here."""
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast


class TikTokenTokenizer(PreTrainedTokenizerFast):
    vocab_files_names = {"tiktoken_file": "tiktoken.model"}

    @classmethod
    def convert_to_native_format(cls, **kwargs):
        kwargs.pop("vocab_file", None)  # transformers' own tiktoken reader would need tiktoken
        kwargs["tokenizer_object"] = Tokenizer.from_file(kwargs.pop("tiktoken_file"))
        return kwargs
'''


def published_config(saved: dict) -> dict:
    """Kimi-K2-Instruct's config.json layout with the tiny values of `saved` (the config.json
    transformers wrote for the tiny DeepseekV3ForCausalLM)."""
    rope = dict(KIMI["rope_parameters"])
    theta = rope.pop("rope_theta")
    rope.pop("rope_type")
    values = {k: saved[k] for k in SHAPE_KEYS}
    values.update(
        architectures=["DeepseekV3ForCausalLM"], attention_bias=False, attention_dropout=0.0,
        auto_map=AUTO_MAP, aux_loss_alpha=0.001, bos_token_id=2, eos_token_id=3,
        first_k_dense_replace=1, hidden_act="silu",
        max_position_embeddings=KIMI["max_position_embeddings"], model_type="kimi_k2",
        moe_layer_freq=1, n_group=1, norm_topk_prob=True, num_nextn_predict_layers=0,
        pretraining_tp=1, rms_norm_eps=1e-6, rope_scaling=dict(rope, type="yarn"),
        rope_theta=theta, routed_scaling_factor=2.827, scoring_func="sigmoid", seq_aux=True,
        tie_word_embeddings=False, topk_group=1, topk_method="noaux_tc", torch_dtype="float32",
        transformers_version="4.48.3", use_cache=True)
    return dict(sorted(values.items()))


def build_kimi_k2(out_dir: str, seed: int = 0) -> str:
    """Save the tiny Kimi-K2 folder (module docstring) to `out_dir`; return it."""
    build_deepseek_v3(out_dir, seed=seed, mtp=False, **KIMI)
    path = os.path.join(out_dir, "config.json")
    with open(path) as f:
        saved = json.load(f)
    with open(path, "w") as f:
        json.dump(published_config(saved), f, indent=2)
    for name in ("configuration_deepseek.py", "modeling_deepseek.py"):
        with open(os.path.join(out_dir, name), "w") as f:
            f.write(STAND_IN.format(name=name))
    return out_dir


def with_custom_tokenizer(src_dir: str, out_dir: str) -> str:
    """A copy of the folder `src_dir` whose tokenizer is its own code (module docstring)."""
    shutil.copytree(src_dir, out_dir)
    os.replace(os.path.join(out_dir, "tokenizer.json"), os.path.join(out_dir, "tiktoken.model"))
    path = os.path.join(out_dir, "tokenizer_config.json")
    with open(path) as f:
        tokenizer_config = json.load(f)
    tokenizer_config.update(tokenizer_class="TikTokenTokenizer", auto_map={
        "AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]})
    with open(path, "w") as f:
        json.dump(tokenizer_config, f, indent=2)
    with open(os.path.join(out_dir, "tokenization_kimi.py"), "w") as f:
        f.write(TOKENIZER_CODE)
    return out_dir

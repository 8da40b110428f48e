"""Tiny random HF models and a local word-level tokenizer with a chat template (no downloads)."""
from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import load_file as load_eager, save_file as save_eager

# transformers renders templates with trim_blocks=True, which eats a literal newline right after
# a block tag; newlines are therefore written as {{ '\n' }} expressions.
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}"
    "<|im_start|>assistant{{ '\\n' }}"
    "{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}{{ '\\n' }}"
    "{% else %}"
    "<|im_start|>{{ m['role'] }}{{ '\\n' }}{{ m['content'] }}<|im_end|>{{ '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{% endif %}"
)

# With images (build_tokenizer(vision=True)): a message's content may be a list of parts
# {"type": "text", "text": ...} / {"type": "image", ...}; an image renders as Qwen's
# <|vision_start|><|image_pad|><|vision_end|> (the processor repeats <|image_pad|> per token).
_CONTENT = ("{% if m['content'] is string %}{{ m['content'] }}{% else %}"
            "{% for p in m['content'] %}{% if p['type'] == 'image' %}"
            "<|vision_start|><|image_pad|><|vision_end|>"
            "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}")
VISION_CHAT_TEMPLATE = CHAT_TEMPLATE.replace("{{ m['content'] }}", _CONTENT)
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]

# Ids 0..3 are fixed: build_tiny_model's config uses pad_token_id=0 and eos_token_id=3.
SPECIAL = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]
# Matched before pre-tokenization (the pre-tokenizer would split them), but not special:
# they survive decode(..., skip_special_tokens=True).
ADDED = ["\n", "\\boxed{"]
BASE_WORDS = (SPECIAL + ["\n", "user", "assistant", "system"]
              + [str(d) for d in range(10)] + list("abcdefghijklmnopqrstuvwxyz")
              + list("+-*/=?.,:;!()")
              + ["\\boxed{", "}", "what", "is", "the", "answer", "sum", "of", "and", "plus",
                 "copy", "repeat"])


def build_tokenizer(out_dir: str, vocab_size: int, vision: bool = False):
    """A word-level tokenizer saved to `out_dir` as a transformers fast tokenizer; returns it.

    Vocabulary: BASE_WORDS in order (so <pad>=0, <unk>=1, <|im_start|>=2, <|im_end|>=3, "\\n"=4,
    digits "0".."9" = 8..17, letters 18..43, punctuation 44..56, "\\boxed{"=57, "}"=58, then
    words), padded with filler words "w0", "w1", ... to exactly `vocab_size` entries.
    Text is split on whitespace; digits and punctuation become tokens of their own; the SPECIAL
    and ADDED strings are matched whole before splitting. Unknown words map to <unk>. Decoding
    joins tokens with single spaces, except none between digits, around "\\n", after
    "\\boxed{" and before "}" (so "\\boxed{42}" and numbers read back as written). The chat
    template marks assistant content and its closing <|im_end|> with {% generation %} for
    return_assistant_tokens_mask. `vision`: the last four ids are VISION_TOKENS (special) and
    the chat template renders image parts (VISION_CHAT_TEMPLATE).
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < len(BASE_WORDS):
        raise ValueError(f"vocab_size={vocab_size} is smaller than the {len(BASE_WORDS)} "
                         "base words of the tiny tokenizer")
    extra = VISION_TOKENS if vision else []
    words = list(BASE_WORDS) + [f"w{i}" for i in range(vocab_size - len(BASE_WORDS)
                                                       - len(extra))] + extra
    vocab = {w: idx for idx, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(),
        pre_tokenizers.Split(pattern=Regex(r"\d"), behavior="isolated"),
        pre_tokenizers.Punctuation(behavior="isolated"),
    ])
    tok.decoder = decoders.Sequence([  # words joined by spaces, then a few tidy-ups
        decoders.WordPiece(prefix="##", cleanup=False), decoders.Fuse(),
        decoders.Replace(Regex(r"(?<=\d) (?=\d)"), ""),  # "1 2" -> "12"
        decoders.Replace(Regex(r" ?\n ?"), "\n"),
        decoders.Replace("\\boxed{ ", "\\boxed{"), decoders.Replace(" }", "}"),
    ])
    tok.add_special_tokens([AddedToken(w, special=True, normalized=False)
                            for w in SPECIAL + extra])
    tok.add_tokens([AddedToken(w, special=False, normalized=False) for w in ADDED])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                   eos_token="<|im_end|>", bos_token=None,
                                   additional_special_tokens=["<|im_start|>"] + extra)
    fast.chat_template = VISION_CHAT_TEMPLATE if vision else CHAT_TEMPLATE
    if len(fast) != vocab_size:
        raise AssertionError(f"tiny tokenizer has {len(fast)} ids, expected {vocab_size}")
    fast.save_pretrained(out_dir)
    return fast


ARCH_DEFAULTS = {
    "qwen3": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], tie_word_embeddings=True,
                  head_dim=16),
    "llama": dict(model_type="llama", architectures=["LlamaForCausalLM"],
                  tie_word_embeddings=False),
    "qwen2": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"],
                  tie_word_embeddings=False),
    # 8 experts, top-2, renormalised: every layer sparse (Qwen3-30B-A3B's structure, tiny)
    "qwen3_moe": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"],
                      tie_word_embeddings=False, head_dim=16, num_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    # 8 experts of width `intermediate` (Mixtral's expert width), top-2, always renormalised;
    # saved as block_sparse_moe.experts.{e}.w1/w2/w3 (transformers' on-disk names)
    "mixtral": dict(model_type="mixtral", architectures=["MixtralForCausalLM"],
                    tie_word_embeddings=False, num_local_experts=8, num_experts_per_tok=2),
}


def build_tiny_model(out_dir: str, arch: str = "qwen3", vocab_size: int = 200, hidden: int = 64,
                     layers: int = 4, heads: int = 8, kv_heads: int = 2, intermediate: int = 128,
                     seed: int = 0, tokenizer: bool = True, **extra) -> str:
    """Save a random tiny HF model (fp32 safetensors) and tokenizer to `out_dir`; return it.
    MoE routers get the same random init as the other weights (HF may leave them at zero,
    which would make every routing decision a tie)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    os.makedirs(out_dir, exist_ok=True)
    cfg = dict(ARCH_DEFAULTS[arch])
    model_type = cfg.pop("model_type")
    cfg.update(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
               num_attention_heads=heads, num_key_value_heads=kv_heads,
               intermediate_size=intermediate, max_position_embeddings=512, rms_norm_eps=1e-6,
               rope_theta=10000.0, dtype="float32", pad_token_id=0, eos_token_id=3,
               bos_token_id=None)
    cfg.update(extra)
    config = AutoConfig.for_model(model_type, **cfg)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # non-trivial norms so a mis-mapped norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):  # router (Qwen3-MoE and Mixtral)
                p.copy_(config.initializer_range * torch.randn_like(p))
    model.save_pretrained(out_dir, safe_serialization=True)
    if tokenizer:
        build_tokenizer(out_dir, vocab_size)
    return out_dir


def build_eos_model(out_dir: str, hidden: int = 32, arch: str = "llama",
                    eos_boost: float = 3.0) -> str:
    """A tiny untied model of `arch` (llama or qwen3_moe; 4 heads of hidden / 4) whose eos
    logit is raised by `eos_boost` along the mean final hidden state (3: eos ~19% per sampled
    token instead of ~0.3% at hidden 32, Llama; Qwen3-MoE at hidden 128 needs about 6 for ~25%),
    so sampled turns end and multi-turn episodes go on. Returns its directory."""
    from transformers import AutoModelForCausalLM

    heads = {"head_dim": hidden // 4} if arch != "llama" else {}
    path = build_tiny_model(out_dir, arch, hidden=hidden, layers=2, heads=4, kv_heads=2,
                            seed=0, initializer_range=0.2, tie_word_embeddings=False, **heads)
    model = AutoModelForCausalLM.from_pretrained(path)
    ids = torch.randint(4, 200, (16, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        mean = model.model(ids).last_hidden_state.reshape(-1, hidden).mean(0)
        model.lm_head.weight[3] += eos_boost * mean / mean.norm() ** 2
    model.save_pretrained(path, safe_serialization=True)
    return path


def eos_prone_model(path: str, eos_scale: float = 2.5, hidden: int = 64, layers: int = 2,
                    heads: int = 8, **extra) -> str:
    """A tiny qwen3 (word-level tokenizer, eos id 3, tied embeddings) whose end-of-sequence
    embedding row is scaled by `eos_scale`: sampled reply lengths spread from 1 token to the
    limit (2.5: at 64 tokens, lengths 1 to 64, mean ~17). `extra`: build_tiny_model's keys
    (head_dim=32 for vLLM's CPU attention). Returns `path`. The partial-rollout benchmark's and
    tests' model (tools.bench.partial), and `python -m tools.demo model --eos-prone`."""
    build_tiny_model(path, "qwen3", hidden=hidden, layers=layers, heads=heads, kv_heads=2,
                     seed=0, initializer_range=0.2, **extra)
    (weights,) = Path(path).glob("*.safetensors")
    state = load_eager(str(weights))
    state["model.embed_tokens.weight"][3] *= eos_scale
    save_eager(state, str(weights), metadata={"format": "pt"})
    return path


def load_hf_model(path: str):
    """transformers' model of an HF folder as a user loads it: the ForConditionalGeneration
    class for a conditional-generation checkpoint (Qwen3.5 as published), else the CausalLM."""
    import json

    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    import models.hf.config  # noqa: F401  (registers model_types transformers lacks: kimi_k2)
    from models.hf.conditional import is_wrapper

    config = json.loads((Path(path) / "config.json").read_text())
    auto = AutoModelForImageTextToText if is_wrapper(config) else AutoModelForCausalLM
    return auto.from_pretrained(path)


def build_peft_adapter(base: str, out: str, rank: int, alpha: float, seed: int = 3,
                       targets="all-linear", parameters: list[str] | None = None,
                       std: float = 0.05, **config) -> str:
    """A PEFT adapter of `targets` (default peft's all-linear: every linear projection, as
    peft reads it on the model: on transformers 5's fused experts also them and the router)
    and of the fused 3-D parameters `parameters` (peft's target_parameters, e.g.
    ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]) of `base`, with non-zero B (peft
    initialises B to 0, which would leave the model unchanged; B ~ N(0, std)); `config`:
    further LoraConfig fields (rank_pattern, alpha_pattern, use_rslora). Returns `out`."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(load_hf_model(base), LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=targets, target_parameters=parameters,
        **config))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, std)
    model.save_pretrained(out)
    return out


def append_mtp_layer(out_dir: str, config: dict, seed: int, attention_tensor: str,
                     attention_shape: tuple[int, int]) -> None:
    """Add a few tensors named as a published MTP layer stores them (`model.layers.{N}.*`, N =
    num_hidden_layers; GLM-4.5 and DeepSeek-V3) to `out_dir/model.safetensors`, one of them
    bf16: tensors the bridge must carry through unchanged (models.hf.passthrough).
    `attention_tensor`: the layer's attention weight suffix, with `attention_shape`."""
    from safetensors.torch import load_file, save_file

    hidden, experts = config["hidden_size"], config["n_routed_experts"]
    head = f"model.layers.{config['num_hidden_layers']}."
    gen = torch.Generator().manual_seed(seed + 1)
    path = os.path.join(out_dir, "model.safetensors")
    tensors = load_file(path)
    tensors.update({
        head + "eh_proj.weight": torch.randn(hidden, 2 * hidden, generator=gen),
        head + "enorm.weight": torch.randn(hidden, generator=gen).to(torch.bfloat16),
        head + "hnorm.weight": torch.randn(hidden, generator=gen),
        head + "shared_head.norm.weight": torch.randn(hidden, generator=gen),
        head + attention_tensor: torch.randn(*attention_shape, generator=gen),
        head + "mlp.gate.e_score_correction_bias": torch.randn(experts, generator=gen)})
    save_file(tensors, path, metadata={"format": "pt"})


def append_full_mtp_layer(out_dir: str, config, seed: int) -> None:
    """Add a complete MTP layer `model.layers.{N}.*` (N = num_hidden_layers; the naming of
    DeepSeek-V3, Kimi-K2 and GLM-4.5 checkpoints and of vLLM's MTP drafters) to
    `out_dir/model.safetensors`, fp32: a random decoder layer of the model's own kind at index N
    (built by transformers for `config` with one more layer), `enorm`, `hnorm`, `eh_proj`,
    `shared_head.norm`, and `shared_head.head` / `embed_tokens` equal to the model's lm_head and
    embedding (as published checkpoints store them). `config`: the transformers config object
    the model was saved from (`architectures` set)."""
    import copy
    import tempfile

    from safetensors.torch import load_file, save_file

    layers = int(config.num_hidden_layers)
    hidden = int(config.hidden_size)
    deeper = copy.deepcopy(config)
    deeper.num_hidden_layers = layers + 1
    if getattr(deeper, "layer_types", None):
        deeper.layer_types = list(deeper.layer_types) + [deeper.layer_types[-1]]
    head = f"model.layers.{layers}."
    with tempfile.TemporaryDirectory() as tmp:
        save_random_model(tmp, deeper, seed + 7, scales={"mlp.gate.weight": 0.1, "bias": 0.1},
                          buffer_scales={"e_score_correction_bias": 0.1})
        extra = {k: v for k, v in load_file(os.path.join(tmp, "model.safetensors")).items()
                 if k.startswith(head)}
    gen = torch.Generator().manual_seed(seed + 11)
    path = os.path.join(out_dir, "model.safetensors")
    tensors = load_file(path)
    lm_head = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])
    extra.update({
        head + "enorm.weight": 1.0 + 0.1 * torch.randn(hidden, generator=gen),
        head + "hnorm.weight": 1.0 + 0.1 * torch.randn(hidden, generator=gen),
        head + "eh_proj.weight": torch.randn(hidden, 2 * hidden, generator=gen)
        * (2 * hidden) ** -0.5,
        head + "shared_head.norm.weight": 1.0 + 0.1 * torch.randn(hidden, generator=gen),
        head + "shared_head.head.weight": lm_head.clone(),
        head + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone()})
    tensors.update(extra)
    save_file(tensors, path, metadata={"format": "pt"})


def save_random_model(out_dir: str, config, seed: int = 0, scales: dict[str, float] = {},
                      buffer_scales: dict[str, float] = {}) -> None:
    """transformers' model for `config` (a config object with `architectures` set), fp32,
    seeded with `seed`, saved to `out_dir` (safetensors). Its own initialisation, except: norm
    weights 1 + 0.1 N(0, 1); a parameter whose name ends with a key of `scales` (the first
    that matches) scale * N(0, 1); a buffer likewise by `buffer_scales` (e.g. a routing bias
    that must change which experts are chosen)."""
    from transformers import AutoModelForCausalLM

    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = next((v for k, v in scales.items() if name.endswith(k)), None)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif scale is not None:
                p.copy_(scale * torch.randn_like(p))
        for name, b in model.named_buffers():
            scale = next((v for k, v in buffer_scales.items() if name.endswith(k)), None)
            if scale is not None:
                b.copy_(scale * torch.randn_like(b))
    model.save_pretrained(out_dir, safe_serialization=True)


def tiny_mtp_model(out_dir: str) -> str:
    """A tiny random GLM-4.5 MoE (head_dim 32, vLLM's CPU minimum) with a complete random MTP
    layer (append_full_mtp_layer) and the tiny tokenizer (`bench spec --quick`, `demo model
    --mtp`: docs/mtp.md's CPU example)."""
    from transformers.models.glm4_moe import Glm4MoeConfig

    config = Glm4MoeConfig(
        vocab_size=200, hidden_size=128, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, moe_intermediate_size=64,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
        first_k_dense_replace=1, norm_topk_prob=True, num_nextn_predict_layers=1,
        max_position_embeddings=512, tie_word_embeddings=False, eos_token_id=3,
        pad_token_id=0, initializer_range=0.2)
    config.architectures = ["Glm4MoeForCausalLM"]
    save_random_model(out_dir, config, 0)
    append_full_mtp_layer(out_dir, config, 0)
    build_tokenizer(out_dir, 200)
    return out_dir

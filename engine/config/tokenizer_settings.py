"""`model.trust_remote_code` (SFT and RL; default false): whether the engines may run the Python
code an HF folder ships for its tokenizer (tokenizer_config.json `auto_map`, e.g. Kimi-K2's
tiktoken-based tokenization_kimi.py). Only the tokenizer's code runs: the model is always
transformers' own class read by the bridge (Kimi-K2: models.families.deepseek_v3.kimi_k2_hf), whatever the key says.

`remote_code_problems` refuses, before any process group exists, a folder whose tokenizer needs
its own code (models.hf.custom_code.custom_tokenizer) while the key is false, naming the key and the
class. Every tokenizer load of engine.sft and engine.rl (the loop, the rollout ranks, the env
template check, the distillation vocabulary check, the HF rollout backend; SGLang gets the key
as its server arg) is models.hf.custom_code.load_tokenizer(path, key).
"""
from __future__ import annotations

from models.hf.custom_code import custom_tokenizer


def remote_code_problems(cfg) -> list[str]:
    """One sentence when the folder at model.hf_path needs its own tokenizer code and
    model.trust_remote_code is false; empty otherwise."""
    path = cfg.model.hf_path
    code = custom_tokenizer(path) if path else None
    if code is None or cfg.model.trust_remote_code:
        return []
    return [f"model.hf_path={path}: its tokenizer is the folder's own code ({code}, "
            "tokenizer_config.json auto_map), which transformers has no class for; set "
            "model.trust_remote_code=true to run it (only the tokenizer's code runs; the model "
            "is transformers' own class)"]

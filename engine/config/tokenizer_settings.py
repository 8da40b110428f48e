"""`model.trust_remote_code` (SFT and RL; default false): whether the engines may run the Python
code an HF folder ships for its tokenizer (tokenizer_config.json `auto_map`, e.g. Kimi-K2's
tiktoken-based tokenization_kimi.py). Only the tokenizer's code runs: the model is always
transformers' own class read by the bridge (Kimi-K2: models.kimi_k2_hf), whatever the key says.

`remote_code_problems` refuses, before any process group exists, a folder whose tokenizer needs
its own code (models.custom_code.custom_tokenizer) while the key is false, naming the key and the
class. engine.sft loads the tokenizer with models.custom_code.load_tokenizer(path, key);
engine.rl's tokenizer loads (the loop, the rollout ranks and the HF rollout backend) do not pass
the key yet, so an RL config (one with `rollout`) that would need it is refused by name too.
"""
from __future__ import annotations

from models.custom_code import custom_tokenizer


def remote_code_problems(cfg) -> list[str]:
    """One sentence when the folder at model.hf_path needs its own tokenizer code and the run
    cannot use it: model.trust_remote_code is false, or the config is engine.rl's (which does
    not pass the key yet); empty otherwise."""
    path = cfg.model.hf_path
    code = custom_tokenizer(path) if path else None
    if code is None or (cfg.model.trust_remote_code and not hasattr(cfg, "rollout")):
        return []
    if hasattr(cfg, "rollout"):  # engine.rl's config
        return [f"model.hf_path={path}: its tokenizer is the folder's own code ({code}, "
                "tokenizer_config.json auto_map); model.trust_remote_code is honoured by "
                "engine.sft only (engine.rl loads tokenizers with transformers' own classes); "
                "supported for RL: a folder whose tokenizer transformers loads (tokenizer.json)"]
    return [f"model.hf_path={path}: its tokenizer is the folder's own code ({code}, "
            "tokenizer_config.json auto_map), which transformers has no class for; set "
            "model.trust_remote_code=true to run it (only the tokenizer's code runs; the model "
            "is transformers' own class)"]

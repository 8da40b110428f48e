"""The HF tensors a config's mapping consumes, and what a checkpoint holds beyond or short
of them (leftovers would be dropped silently by a loader that only reads what it knows)."""
from __future__ import annotations

import re
from typing import Any, Iterable

from models.families.base import field, original_config
from models.families.mtp import mtp_tensor_names, trained_mtp_layers
from models.families.registry import family_of
from models.formats.quantized import logical_names

# Tensors transformers itself drops on load: RoPE buffers of old checkpoints (recomputed from
# the config). With tied embeddings a stored lm_head.weight is replaced by the embedding.
_IGNORED = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")
_LISTED = 8  # tensor names quoted in a message


def expected_tensors(hf_config: Any) -> set[str]:
    """Every HF tensor name the mapping reads for this config."""
    layers = field(hf_config, "num_hidden_layers")
    fam = family_of(hf_config)
    names = {f"model.layers.{i}.{s}" for i in range(layers)
             for s in fam.layer_tensors_of(hf_config, i)}
    names |= {"model.embed_tokens.weight", "model.norm.weight"}
    if not field(hf_config, "tie_word_embeddings", False):
        names.add("lm_head.weight")
    for k in range(trained_mtp_layers(hf_config)):  # models.layers.mtp.mapping
        mtp = mtp_tensor_names(hf_config, k)  # its own, its decoder layer's, the copies
        names |= set(mtp.own().values()) | set(mtp.copies)
        names |= {mtp.layer_prefix + s for s in fam.layer_tensors_of(hf_config, layers + k)}
    return names


def _listing(names: list[str]) -> str:
    more = f" ... ({len(names) - _LISTED} more)" if len(names) > _LISTED else ""
    return ", ".join(names[:_LISTED]) + more


def is_vision_tensor(hf_config: Any, name: str) -> bool:
    """Whether `name` is a tensor of the vision tower of a conditional-generation checkpoint
    (its family's `vision_prefix`); models.vision.tower checks that they are exactly the
    tower's parameters."""
    prefix = family_of(hf_config).vision_prefix
    return bool(prefix) and original_config(hf_config) is not None and name.startswith(prefix)


def tensor_problems(hf_config: Any, names: Iterable[str]) -> list[str]:
    """Tensors of a checkpoint (`names`) the mapping would not consume, and tensors it needs
    that are missing; empty when they match exactly."""
    names = set(logical_names(hf_config, names))  # a quantized weight's scales: models.formats.quantized
    expected = expected_tensors(hf_config)
    tied = bool(field(hf_config, "tie_word_embeddings", False))
    fam = family_of(hf_config)
    extra = sorted(n for n in names - expected
                   if not _IGNORED.match(n) and not (tied and n == "lm_head.weight")
                   and not fam.passthrough(hf_config, n)  # carried: models.hf.passthrough
                   and not is_vision_tensor(hf_config, n))  # checked by models.vision.tower
    missing = sorted(expected - names)
    problems = []
    if extra:
        problems.append(f"the checkpoint holds {len(extra)} tensor(s) the {fam.model_type} "
                        f"mapping would not consume (they would be dropped): {_listing(extra)}; "
                        "check that config.json matches the weights (e.g. attention_bias, "
                        "mlp_bias, num_hidden_layers)")
    if missing:
        problems.append(f"the checkpoint lacks {len(missing)} tensor(s) the {fam.model_type} "
                        f"mapping needs: {_listing(missing)}")
    return problems

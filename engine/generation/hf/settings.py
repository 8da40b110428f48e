"""rollout.hf.* (engine.rl.config.HFRolloutConfig): the HF backend's static KV cache and
compiled decode step (engine.generation.hf.static_decode), resolved (`resolve`) and checked
before any process group starts (`hf_problems`, each sentence naming its key).

null resolves per device: on with CUDA, off on a CPU. On the 2-core CPU host the compiled path
measured 1.1-1.2x eager tokens/s after 20-40 s of compilation per run (docs/rollout-backends.md),
which the short CPU runs and tests never earn back; `true` runs there too.
"""
from __future__ import annotations

from models.hf.conditional import original_config, text_view

KEYS = ("static_cache", "compile")


def resolve(static_cache: bool | None, compile: bool | None, device_type: str
            ) -> tuple[bool, bool]:
    """(static cache, compile) for an engine on `device_type` from the two settings (null: on
    with CUDA, off elsewhere; compile only over the static cache). Raises ValueError naming the
    key for a non-boolean, or for compile=true with static_cache=false."""
    for key, value in zip(KEYS, (static_cache, compile)):
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"rollout.hf.{key}={value!r} must be true, false or null")
    if compile and static_cache is False:
        raise ValueError("rollout.hf.compile=true needs rollout.hf.static_cache true or null "
                         "(a decode step over the growing dynamic cache changes shape every "
                         "step, so it would compile every step)")
    cuda = device_type == "cuda"
    static = cuda if static_cache is None else static_cache
    if compile is None:
        compile = cuda and static
    return static or compile, compile


def hf_problems(cfg, hf_config: dict) -> list[str]:
    """Why rollout.hf.* cannot run with this config and checkpoint (`hf_config`: its
    config.json), one sentence per problem naming the key: non-boolean values, compile=true
    with static_cache=false, and, with rollout.backend=hf, either switch set true for a
    checkpoint the static path does not serve (a conditional-generation checkpoint, layer types
    other than full attention) or together with moe.routing_replay=R3 (the routed experts are
    recorded by the eager loop)."""
    settings = cfg.rollout.hf
    try:
        resolve(settings.static_cache, settings.compile, "cpu")
    except ValueError as e:
        return [str(e)]
    if cfg.rollout.backend != "hf":
        return []
    on = [f"rollout.hf.{k}=true" for k in KEYS if getattr(settings, k) is True]
    if not on:
        return []
    which, p = " and ".join(on), []
    if original_config(hf_config) is not None:
        p.append(f"{which} is not built for a conditional-generation checkpoint (image prompts "
                 "decode on the eager loop); set rollout.hf.static_cache and rollout.hf.compile "
                 "to null or false")
    types = sorted(set(text_view(hf_config).get("layer_types") or ["full_attention"])
                   - {"full_attention"})
    if types:
        p.append(f"{which}: the checkpoint's layer types {types} are not plain full attention, "
                 "which the static cache path needs; set them to null or false")
    if getattr(cfg.moe, "routing_replay", None) == "R3":
        p.append(f"{which} with moe.routing_replay=R3: the routed experts are recorded by the "
                 "eager decode loop; set them to null or false")
    return p

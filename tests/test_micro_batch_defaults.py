"""RL's micro-batching defaults, and the SFT family's (engine.config.micro_batch_defaults, issue
102 item 2): the token budget sized from the model and train.seq_length, train.prefix_sharing=auto
resolved, the keys a user sets kept, and the RL schema's refusals. Pure configuration: no process
group, no model."""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from engine.config.micro_batch_defaults import (ACTIVATION_BUDGET_GIB, MAX_SEQUENCES,
                                                activation_bytes_per_token, default_token_budget,
                                                resolve_micro_batching, resolved_train)
from engine.config.prefix_sharing_settings import prefix_sharing_problems
from engine.rl.config import RLConfig
from models.estimate.training_memory import GIB

SMALL = {"model_type": "qwen3", "hidden_size": 384, "intermediate_size": 1024,
         "num_hidden_layers": 4, "num_attention_heads": 6, "num_key_value_heads": 2,
         "head_dim": 64, "vocab_size": 1000}
EIGHT_B = {"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288,
           "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
           "head_dim": 128, "vocab_size": 151936}


def _cfg(**train):
    cfg = OmegaConf.structured(RLConfig)
    cfg.model.hf_path = "/m"
    for key, value in train.items():
        cfg.train[key] = value
    return cfg


def test_rl_defaults_are_null_budget_and_auto_sharing():
    cfg = _cfg()
    assert cfg.train.micro_batch_size is None and cfg.train.max_tokens_per_micro_batch is None
    assert cfg.train.prefix_sharing == "auto"


def test_default_budget_follows_the_model_within_its_bounds():
    small = default_token_budget(SMALL, 512, bf16=False)
    assert small == MAX_SEQUENCES * 512            # a small model: capped at 16 sequences
    big = default_token_budget(EIGHT_B, 4096, bf16=True, loss_chunk_tokens=1024)
    assert big == 4096                             # an 8B model: one full sequence
    mid = {**EIGHT_B, "num_hidden_layers": 2}      # in between: the 8 GiB rule itself
    budget = default_token_budget(mid, 4096, bf16=True, loss_chunk_tokens=1024)
    per_token = activation_bytes_per_token(mid, True, 4096, 1024)
    assert 4096 < budget < MAX_SEQUENCES * 4096
    assert budget == int(ACTIVATION_BUDGET_GIB * GIB // per_token)
    # more layers keep more bytes per token: never a larger budget
    assert default_token_budget({**mid, "num_hidden_layers": 4}, 4096, True, 1024) < budget


def test_auto_resolves_to_sharing_and_the_budget():
    micro = resolve_micro_batching(_cfg(), SMALL)
    assert micro.prefix_sharing is True
    assert micro.max_tokens_per_micro_batch == default_token_budget(SMALL, 512, False, 1024)
    assert "prefix sharing on (train.prefix_sharing=auto" in micro.header
    assert "a token budget of" in micro.header and "default" in micro.header


def test_auto_is_off_with_the_reason_where_true_is_refused():
    cfg = _cfg()
    cfg.model.mtp.enabled = True
    micro = resolve_micro_batching(cfg, SMALL)
    assert micro.prefix_sharing is False
    assert "off (train.prefix_sharing=auto" in micro.header and "model.mtp.enabled" in micro.header
    assert prefix_sharing_problems(cfg, SMALL) == []          # auto refuses nothing
    cfg.train.prefix_sharing = True                            # true does (OmegaConf: "True")
    assert any("model.mtp.enabled" in p for p in prefix_sharing_problems(cfg, SMALL))


def test_keys_a_user_sets_keep_their_meaning():
    micro = resolve_micro_batching(_cfg(micro_batch_size=4, prefix_sharing="false"), SMALL)
    assert (micro.micro_batch_size, micro.max_tokens_per_micro_batch) == (4, None)
    assert micro.prefix_sharing is False and "4 sequences each" in micro.header
    micro = resolve_micro_batching(_cfg(max_tokens_per_micro_batch=300), SMALL)
    assert micro.max_tokens_per_micro_batch == 300
    assert "train.max_tokens_per_micro_batch" in micro.header
    micro = resolve_micro_batching(_cfg(micro_batch_size=2), SMALL)   # sharing: groups
    assert micro.prefix_sharing and "2 groups of rows sharing a prefix" in micro.header
    view = resolved_train(_cfg(), SMALL)                       # what --recipe plans with
    assert view.max_tokens_per_micro_batch == default_token_budget(SMALL, 512, False, 1024)
    assert view.micro_batch_size == 1 and view.seq_length == 512


@pytest.mark.parametrize("value", ["maybe", "2"])
def test_an_unknown_choice_is_refused_by_name(value):
    problems = prefix_sharing_problems(_cfg(prefix_sharing=value), SMALL)
    assert problems == [f"train.prefix_sharing={value!r} is not one of "
                        "['auto', 'true', 'false']"]


def test_sft_family_defaults_to_the_same_budget_and_keeps_keys_a_user_sets():
    """SFT, DPO, KTO and reward models (SFT's train.* keys): both keys null by default, resolved
    once into RL's default budget (micro_batch_size 1 beside it) with the header saying so; a
    user's micro_batch_size or budget is kept (and the budget gets micro_batch_size 1)."""
    from engine.config.micro_batch_defaults import apply_sft_micro_batching, per_micro_batch
    from engine.config.schema import SFTConfig

    def sft(**train):
        cfg = OmegaConf.to_object(OmegaConf.structured(SFTConfig))
        for key, value in train.items():
            setattr(cfg.train, key, value)
        return cfg

    cfg = sft()
    assert cfg.train.micro_batch_size is None and cfg.train.max_tokens_per_micro_batch is None
    header = apply_sft_micro_batching(cfg, SMALL)
    budget = default_token_budget(SMALL, 512, False, cfg.train.loss_chunk_tokens or None)
    assert (cfg.train.micro_batch_size, cfg.train.max_tokens_per_micro_batch) == (1, budget)
    assert header.startswith(f"micro-batches: a token budget of {budget} (default:")
    assert per_micro_batch(cfg.train) == f"a token budget of {budget} per micro-batch"
    # a second call (a resumed build) keeps what the first chose
    assert apply_sft_micro_batching(cfg, SMALL).endswith("(train.max_tokens_per_micro_batch)")
    cfg = sft(micro_batch_size=4)
    assert apply_sft_micro_batching(cfg, SMALL) == "micro-batches: 4 each (train.micro_batch_size)"
    assert (cfg.train.micro_batch_size, cfg.train.max_tokens_per_micro_batch) == (4, None)
    assert per_micro_batch(cfg.train, 2) == "2 per micro-batch"
    cfg = sft(max_tokens_per_micro_batch=1000)
    apply_sft_micro_batching(cfg, SMALL)
    assert (cfg.train.micro_batch_size, cfg.train.max_tokens_per_micro_batch) == (1, 1000)

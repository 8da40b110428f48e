"""Prefix sharing (train.prefix_sharing) on the objectives tests/multirank/prefix_sharing_check.py
does not run: KTO, reward models and on-policy distillation, sharing off against on on the same
batches, at one process (run on a pool rank by tests/test_prefix_sharing_objectives.py).

`run(model_dir, teacher_dir, objective, sharing, control)` returns {"table": per-token outputs
of the first batch's rows ([rows][max length] floats), "steps": [metrics per optimizer step]}
for one mode, and the number of split tree-attention calls (parallel.tree_attention_split: the
prompts are long enough), and the test compares the modes:
  kto:     STEPS engine.kto.training.kto_steps (frozen reference, the KL reference point from
           the mismatched sequences) on unpaired examples, four per prompt; the table: the
           policy's token log-probs of the first batch's examples;
  rm:      STEPS engine.rm.training.rm_steps (Bradley-Terry, seeded score row) on pairs sharing
           their prompts; the table: the score head's value at every token of the first
           batch's sides (engine.rl.policy.critic.compute_token_values);
  distill: a frozen teacher (another tiny Qwen3) scores a GRPO batch's sampled tokens, the
           advantages move by coef * (old - teacher) (engine.rl.algo.distill), then STEPS
           policy updates; the table: the teacher's token log-probs.
`control` runs the on-mode with the tree attention broken (a row sees its sibling branches:
prefix_sharing_check.broken("sibling_visible")), the negative control.
"""
from __future__ import annotations

import random
from types import SimpleNamespace

STEPS = 3
PROMPTS, PER_PROMPT = 2, 4
PROMPT_MIN = 260   # >= parallel.tree_attention_split.SPLIT_MIN_KEYS: the split attention runs


def _prompt_rows(vocab: int, seed: int) -> list[tuple[list[int], list[list[int]]]]:
    """PROMPTS prompts of 260..270 tokens, each with PER_PROMPT completions of 3..14 tokens."""
    rng = random.Random(seed)
    out = []
    for _ in range(PROMPTS):
        length = rng.randint(PROMPT_MIN, PROMPT_MIN + 10)
        prompt = [rng.randrange(4, vocab) for _ in range(length)]
        out.append((prompt, [[rng.randrange(4, vocab) for _ in range(rng.randint(3, 14))]
                             for _ in range(PER_PROMPT)]))
    return out


def _sample(prompt: list[int], completion: list[int]):
    from engine.data.datasets import Sample

    ids = prompt + completion
    return Sample(ids[:-1], ids[1:], [0] * (len(prompt) - 1) + [1] * len(completion))


def _train(sharing: bool):
    return SimpleNamespace(micro_batch_size=2, max_tokens_per_micro_batch=None,
                           balance_dp=True, packing=True, prefix_sharing=sharing)


def _policy(model_dir: str, hf_config: dict, train, **kw):
    import torch

    from engine.training.train_engine import TrainEngine
    from tests.multirank.rl_invariance import optim_settings

    return TrainEngine.build(hf_config, optim_settings(), torch.float32, STEPS, train,
                             weights_dir=model_dir, loss_chunk_tokens=16, **kw)


def _table(values) -> "object":
    import torch
    return torch.as_tensor(values, dtype=torch.float64).clone()


def kto_run(model_dir: str, hf_config: dict, train, _teacher: str) -> dict:
    import torch

    from engine.data.preference_unpaired_dataset import UnpairedExample
    from engine.kto.training import kto_step
    from engine.preference.reference import Reference
    from engine.rl.policy.logprobs import compute_token_logprobs
    from engine.training.train_engine import TrainEngine
    from tests.multirank.kto_check import run_cfg

    policy = _policy(model_dir, hf_config, train)
    frozen = TrainEngine.frozen(hf_config, torch.float32, model_dir, train, 0,
                                loss_chunk_tokens=16)
    reference = Reference(policy, frozen, False, True, None)
    cfg = run_cfg({})
    cfg.train.seq_length = 512
    steps, table = [], None
    for step in range(STEPS):
        examples = [UnpairedExample(_sample(p, c), len(p), (k + step) % 3 != 0)
                    for p, cs in _prompt_rows(hf_config["vocab_size"], step)
                    for k, c in enumerate(cs)]
        if table is None:
            table = _table(compute_token_logprobs(policy, [
                _as_seq(e.sample) for e in examples], 1.0))
        steps.append(kto_step(policy, reference, examples, cfg))
    policy.release()
    frozen.release()
    return {"table": table, "steps": steps}


def _as_seq(sample):
    from engine.training.micro_batches import SequenceData
    return SequenceData(sample.tokens, sample.labels, sample.loss_mask)


def rm_run(model_dir: str, hf_config: dict, train, _teacher: str) -> dict:
    from engine.rl.policy.critic import compute_token_values
    from engine.rm.training import pair_sequences, rm_step, score_head_setup
    from tests.multirank.rm_check import run_cfg

    cfg = run_cfg({}, model_dir)
    reader, prepare = score_head_setup(cfg, hf_config)
    engine = _policy(model_dir, hf_config, train, reader=reader, prepare=prepare)
    steps, table = [], None
    for step in range(STEPS):
        pairs = [SimpleNamespace(chosen=_sample(p, cs[2 * j]), rejected=_sample(p, cs[2 * j + 1]),
                                 margin=None)
                 for p, cs in _prompt_rows(hf_config["vocab_size"], 10 + step)
                 for j in range(PER_PROMPT // 2)]
        if table is None:
            table = _table(compute_token_values(engine, pair_sequences(pairs, 0)[0]))
        steps.append(rm_step(engine, pairs, cfg))
    engine.release()
    return {"table": table, "steps": steps}


def distill_run(model_dir: str, hf_config: dict, train, teacher_dir: str) -> dict:
    import torch

    from engine.rl.algo.distill import apply_distillation
    from engine.rl.collect.batch import RolloutBatch, build_sequences
    from engine.rl.policy.logprobs import attach_extra, compute_token_logprobs
    from engine.rl.policy.update import PolicyLossSettings, policy_update
    from engine.training.train_engine import TrainEngine
    from models.hf.io import read_config

    policy = _policy(model_dir, hf_config, train)
    teacher = TrainEngine.frozen(read_config(teacher_dir), torch.float32, teacher_dir, train, 0,
                                 loss_chunk_tokens=16)
    groups = _prompt_rows(hf_config["vocab_size"], 20)
    prompts = [p for p, cs in groups for _ in cs]
    replies = [c for _, cs in groups for c in cs]
    advantages = torch.randn(len(replies), generator=torch.Generator().manual_seed(2)).tolist()
    seqs = build_sequences(RolloutBatch(prompts, replies, [[0.0] * len(r) for r in replies],
                                        advantages))
    sampled = [list(s.loss_mask) for s in seqs]
    old = compute_token_logprobs(policy, seqs, 0.8)
    teacher_table = compute_token_logprobs(teacher, seqs, 0.8)
    for name, values in (("old_logprobs", old), ("rollout_logprobs", old),
                         ("ref_logprobs", old), ("teacher_logprobs", teacher_table)):
        attach_extra(seqs, name, values)
    kl = apply_distillation(seqs, sampled, coef=0.5)
    settings = PolicyLossSettings(vocab_size=policy.vocab_size, temperature=0.8, eps_low=0.2,
                                  eps_high=0.28, kl_beta=0.0)
    loss_cfg = SimpleNamespace(agg_mode="token-mean", count_empty_sequences=True)
    steps = [{**policy_update(policy, seqs, loss_cfg, settings, 40), **kl}
             for _ in range(STEPS)]
    policy.release()
    teacher.release()
    return {"table": _table(teacher_table), "steps": steps}


RUNS = {"kto": kto_run, "rm": rm_run, "distill": distill_run}


def run(model_dir: str, teacher_dir: str, objective: str, sharing: bool,
        control: bool = False) -> dict:
    """One mode of one objective (module docstring); `control`: the broken attention."""
    import contextlib

    from models.hf.io import read_config
    from parallel.layout import ParallelLayout
    from parallel.process_groups import setup_model_parallel
    from tests.multirank.prefix_sharing_check import broken

    import parallel.tree_attention as tree_attention

    setup_model_parallel(ParallelLayout(1))
    context = broken("sibling_visible") if control else contextlib.nullcontext()
    split, calls = tree_attention.split_tree_attention, []

    def counted(*args):
        calls.append(1)
        return split(*args)
    tree_attention.split_tree_attention = counted
    try:
        with context:
            out = RUNS[objective](model_dir, read_config(model_dir), _train(sharing),
                                  teacher_dir)
    finally:
        tree_attention.split_tree_attention = split
    # plain lists and floats back to the test (a tensor would travel as shared memory)
    return {"table": out["table"].tolist(), "split_calls": len(calls),
            "steps": [{k: float(v) for k, v in s.items() if isinstance(v, (int, float))}
                      for s in out["steps"]]}

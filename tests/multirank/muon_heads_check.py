"""optim.name=muon and the value / score heads (models.layers.heads.value), on a 1-rank pool
(tests/test_muon.py::test_value_and_score_heads_are_updated_by_adamw_under_muon).

`head_step(bias, unmark)`: a tiny Qwen3 TrainEngine with a PPO critic's value head (`bias`) or
a reward model's score head, optim.name=muon (fp32, Newton-Schulz in fp32); every gradient zero
but the head weight's, a tiny one (|g| 1e-9..3e-9, below Adam's eps 1e-8); one optimizer step.
Returns which torch optimizer holds each head parameter and the embedding, the gradient and the
head weight's update. `unmark`: remove the output-parameter mark before the optimizer is built
(the engine before the fix), the negative control."""
from __future__ import annotations

import torch
from transformers import AutoConfig

from engine.config.optim_settings import MuonConfig, OptimConfig
from engine.training.train_engine import BatchSettings, TrainEngine
from models.layers.heads.value import attach_value_heads, seeded_row, value_head
from parallel.layout import ParallelLayout
from parallel.process_groups import setup_model_parallel
from parallel.wrappers import unwrap

HIDDEN = 64
LR = 1e-2
EPS = 1e-8


def tiny_hf_config() -> dict:
    """A 2-layer Qwen3 config (hidden 64, vocab 200) as transformers writes it."""
    return AutoConfig.for_model(
        "qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=200, hidden_size=HIDDEN,
        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
        intermediate_size=128, max_position_embeddings=512, rms_norm_eps=1e-6,
        rope_theta=10000.0, tie_word_embeddings=False, dtype="float32").to_dict()


def _optimizer_of(engine) -> dict[int, str]:
    """id(parameter) -> class name of the torch optimizer that updates it."""
    return {id(p): type(opt.optimizer).__name__
            for opt in engine.optimizer.chained_optimizers
            for group in opt.optimizer.param_groups for p in group["params"]}


def head_step(bias: bool, unmark: bool) -> dict:
    setup_model_parallel(ParallelLayout(1))
    optim = OptimConfig(name="muon", distributed_optimizer=False, lr=LR, eps=EPS,
                        weight_decay=0.0, muon=MuonConfig(fp32_matmul_prec="highest"))

    def prepare(raw: list) -> None:
        attach_value_heads(raw, bias=bias,
                           row=None if bias else seeded_row(HIDDEN, 0.02, seed=0))
        if unmark:
            del value_head(raw).weight.is_embedding_or_output_parameter

    engine = TrainEngine.build(tiny_hf_config(), optim, torch.float32, 1, BatchSettings(),
                               load_weights=False, prepare=prepare)
    head = value_head(engine.chunks)
    owner = _optimizer_of(engine)
    embedding = unwrap(engine.chunks[0]).embedding.word_embeddings.weight
    for chunk in engine.chunks:
        for p in chunk.parameters():
            if p.requires_grad:
                p.main_grad.zero_()
    signs = torch.tensor([(-1.0) ** i for i in range(HIDDEN)])
    grad = (torch.linspace(1e-9, 3e-9, HIDDEN) * signs).reshape(1, HIDDEN)
    head.weight.main_grad.copy_(grad)
    before = head.weight.detach().clone()
    engine.optimizer.step()
    return {"weight": owner.get(id(head.weight)),
            "bias": owner.get(id(head.bias)) if head.bias is not None else None,
            "embedding": owner.get(id(embedding)),
            "grad": grad.flatten().tolist(),
            "delta": (head.weight.detach() - before).flatten().tolist()}

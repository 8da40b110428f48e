"""The scalar value head of a PPO critic: v_t = h_t . w + b on the last pipeline stage.

A critic is the policy's GPTModel with this head on its final hidden states instead of the
output layer (which the critic never uses: it is frozen, so it holds no gradient, optimizer
state or DDP bucket). The head is tensor-parallel like a RowParallelLinear with one output:
TP rank r holds w's slice [1, h/tp] over the hidden dimension (megatron's tensor-parallel
attributes, partition dim 1, so checkpoints and the grad norm see one weight) and multiplies
its slice of the TP-replicated hidden states; the partial products are all-reduced (SUM) over
TP, backward identity, so the gradient a rank gives the hidden states is non-zero only on its
slice and the TP sum in models.layers.heads.output's backward assembles the full gradient once. The
bias [1] is replicated over TP (every rank computes the same gradient for it).

The head is an output layer for the optimizer: its weight carries megatron's
`is_embedding_or_output_parameter` (as GPTModel marks its embedding and output layer), so
optim.name=muon updates it with AdamW like the output layer, not with Muon (megatron-core's
get_megatron_muon_optimizer sends every other 2-D weight to Muon, where Newton-Schulz of a
rank-1 momentum is its unit direction: the head would move a fixed length every step whatever
the gradient). The attribute also puts it under `decoupled_lr` where that is set.

A new critic head starts at zero (w = 0, b = 0: every value 0), independent of the layout.
HF form (a critic export, transformers' *ForTokenClassification with num_labels 1):
`score.weight` [1, h] and `score.bias` [1].

A reward model's score head is the same head without a bias (transformers'
*ForSequenceClassification with num_labels 1: `score.weight` [1, h] only; models.bridge.
reward_model). A new one starts from a seeded normal row (`seeded_row`): the full [1, h] row is
drawn on every rank from the same generator and each TP rank keeps its slice, so the start does
not depend on the layout.
"""
from __future__ import annotations

import torch
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from parallel.wrappers import unwrap


class ValueHead(torch.nn.Module):
    def __init__(self, hidden_size: int, dtype: torch.dtype, device, bias: bool = True) -> None:
        super().__init__()
        tp = ps.get_tensor_model_parallel_world_size()
        if hidden_size % tp:
            raise ValueError(f"hidden size {hidden_size} is not divisible by tp={tp}")
        self.width = hidden_size // tp
        self.start = ps.get_tensor_model_parallel_rank() * self.width
        self.weight = torch.nn.Parameter(torch.zeros(1, self.width, dtype=dtype, device=device))
        set_tensor_model_parallel_attributes(self.weight, is_parallel=True, dim=1, stride=1)
        self.weight.is_embedding_or_output_parameter = True   # AdamW under Muon (module docstring)
        self.bias = (torch.nn.Parameter(torch.zeros(1, dtype=dtype, device=device)) if bias
                     else None)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None) -> dict:
        """Checkpoint form: the weight sharded over TP along the hidden dimension (one global
        [1, h] tensor whatever the layout), the bias replicated."""
        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True),
                                                   prefix, {"weight": 1}, sharded_offsets)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[b, s, h] TP-replicated hidden states -> [b, s] float32 values (collective over
        TP: a SUM all-reduce)."""
        local = hidden[..., self.start:self.start + self.width]
        partial = torch.matmul(local, self.weight.t())
        value = reduce_from_tensor_model_parallel_region(partial)
        if self.bias is not None:
            value = value + self.bias
        return value.squeeze(-1).float()

    def load_row(self, row: torch.Tensor) -> None:
        """Set the weight from the FULL [1, h] row (this TP rank keeps its slice)."""
        with torch.no_grad():
            self.weight.copy_(row.reshape(1, -1)[:, self.start:self.start + self.width])


def seeded_row(hidden_size: int, std: float, seed: int) -> torch.Tensor:
    """float32 [1, hidden_size] ~ N(0, std^2) from torch.Generator seeded with `seed` (the same
    on every rank and layout: a new reward model's score row)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(1, hidden_size, generator=generator, dtype=torch.float32) * std


def attach_value_heads(chunks: list, bias: bool = True, row: torch.Tensor | None = None) -> None:
    """Give the last-stage chunk of `chunks` (raw GPTModels, before DDP) a ValueHead as
    `value_head` (zero, or this TP rank's slice of the full [1, h] `row`; without a bias for a
    reward model's score head) and freeze its output layer (tied embeddings stay trainable: the
    input uses them)."""
    for chunk in chunks:
        model = unwrap(chunk)
        if not model.post_process:
            continue
        weight = model.embedding.word_embeddings.weight if model.pre_process else \
            next(model.parameters())
        model.value_head = ValueHead(model.config.hidden_size, weight.dtype, weight.device, bias)
        if row is not None:
            model.value_head.load_row(row)
        if not model.share_embeddings_and_output_weights:
            model.output_layer.weight.requires_grad_(False)


def value_head(chunks: list) -> ValueHead | None:
    """This rank's value head (the last pipeline stage's), or None on other stages."""
    heads = [unwrap(c).value_head for c in chunks if getattr(unwrap(c), "value_head", None)]
    return heads[-1] if heads else None

"""Starting the Tinker service's Megatron backend on one rank: the process groups at the
command's layout, this rank's model and adapters (engine.tinker.mcore), and its part in the
lockstep (engine.tinker.lockstep): rank 0 gets the Lockstep its service calls, every other
rank a `Follower` that runs rank 0's calls until it stops. Rank 0 also loads the HF folder
for sampling (engine.tinker.sampler: a transformers model, or vLLM's with `--sampler vllm`):
one more copy of the base weights on its device."""
from __future__ import annotations

import torch.distributed as dist
from transformers import AutoTokenizer

from engine.tinker.adapters import Adapters
from engine.tinker.lockstep import Lockstep, channel, follow
from engine.tinker.mcore import MegatronLora
from engine.tinker.mcore_ranks import MegatronRanks
from engine.tinker.samplers import SamplerSettings, make_sampler
from parallel.layout import ParallelLayout
from parallel.process_groups import init_distributed, setup_model_parallel


class Follower:
    """A rank other than 0: runs rank 0's calls until it stops (`run`)."""

    def __init__(self, adapters: Adapters, group):
        self.adapters, self.group = adapters, group

    def run(self) -> None:
        follow(self.adapters, self.group)


def megatron_backend(model_dir: str, layout: ParallelLayout,
                     settings: SamplerSettings = SamplerSettings()) -> Lockstep | Follower:
    """Collective over the `layout.world_size` ranks torchrun started: layout.dp
    data-parallel replicas of the model in `model_dir`, each over tp x pp x cp ranks (Ulysses
    context parallelism over cp; a MoE model's experts over ep of the replicas)."""
    init_distributed()
    setup_model_parallel(layout)
    lora = MegatronLora(model_dir, layout.sequence_parallel)
    root = dist.get_rank() == 0
    # rank 0 samples: on the engine's hf generation backend over a transformers copy of the
    # model, or on vLLM (engine.tinker.samplers.make_sampler)
    sampler = make_sampler(settings, model_dir, AutoTokenizer.from_pretrained(model_dir).decode,
                           None) if root else None
    adapters = Adapters(lora, MegatronRanks(), sampler)
    group = channel()
    if not root:
        return Follower(adapters, group)
    print(f"tinker: Megatron backend, {layout.world_size} ranks: tp {layout.tp} (sequence "
          f"parallel {'on' if layout.sequence_parallel else 'off'}), pp {layout.pp}, "
          f"cp {layout.cp}, ep {layout.ep}, dp {layout.dp}", flush=True)
    return Lockstep(adapters, group)

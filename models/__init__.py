"""The model side: HF checkpoints <-> Megatron-Core models, for every family in models.families.

The tree shows the architecture (docs/design/architecture.md, "models/"); packages from the
top of the import order to the bottom, each importing only packages below it:

- `bridge/`   HF <-> Megatron weights at any TP/PP/VPP/EP (`weights.py`, one table of layer
              kinds), Megatron distributed checkpoints (`checkpoint.py`), the PPO critic in HF form.
- `build/`    the GPTModel chunks of a rank (`factory.py`), the TransformerConfig of an HF
              config, forward-only logits.
- `estimate/` parameter counts, memory and communication per GPU for a parallel layout: the sums
              over a layout of the per-layer formulas that live beside their layer kinds.
- `lora/`     LoRA adapters on Megatron's linears and PEFT adapter folders.
- `layers/`   one package per layer kind (attention with sinks, MLA, Gated DeltaNet, experts,
              biased experts, sigmoid routing, norms, heads): module, spec, weight mapping and
              cost formulas of that kind.
- `hf/`       HF config and checkpoint I/O: transformers config objects, safetensors folders,
              conditional-generation wrappers, custom code, quantized export and sync streams.
- `families/` what each architecture declares, as data (field tables, tensors, layer kinds,
              LoRA support, presets); the registry by model_type.
- `formats/`  published quantized formats (block-scaled FP8, MXFP4) and their dispatch.

Package __init__ files import nothing (an __init__ runs before each of its modules; importing
submodules from it is how import cycles hide). Every package's docstring says what it may
import; tests/test_structure.py checks it, and tests/test_imports.py imports every module first
in a fresh process.

May import: parallel (this file: the CPU host's import hook, before any megatron import).
"""
from parallel.cpu_runtime import skip_megatron_jit_on_cpu

skip_megatron_jit_on_cpu()  # before any megatron import of the process (idempotent)

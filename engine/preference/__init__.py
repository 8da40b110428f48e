"""The preference core that DPO, KTO and reward models share (docs/preference.md): the
per-sequence sums of a micro-batch summed over context parallelism and the per-token
coefficients of the exact gradient (table.py), the small float64 autograd of a non-linear
per-sequence loss (gradients.py), the per-sequence weights of a chosen subset of completions
(weights.py), TRL's mean logits (logits.py), the frozen reference's completion log-prob sums
(reference.py), the run loop and data loaders (run.py), the metrics every step logs beside
its objective's (step_metrics.py) and the chunked evaluation (evaluation.py).
Each objective (engine.dpo, engine.kto, engine.rm) keeps only its loss and its metrics.

May import config, data, training, checkpoint and run; never sft, rl, dpo, kto, rm, serve or
api. Only dpo, kto and rm import it, and none of them imports another.
"""

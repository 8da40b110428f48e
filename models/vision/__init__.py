"""Images in the trainer: the vision tower of a conditional-generation checkpoint, M-RoPE, and
the decoder input with image features in place of the image placeholder tokens.

- `spec`: what a checkpoint's config.json says about its images (token ids, merge size,
  M-RoPE sections); `vision_spec(hf_config)` is None for a text-only model.
- `positions`: the 3-D (temporal, height, width) M-RoPE positions of a token sequence with
  images, as transformers' `get_rope_index` computes them.
- `inputs`: `ImageSet` (one sequence's processed images, held or produced on first use from a
  reference into the data cache), `VisionBatch` (one micro-batch's, built by
  engine.training.micro_batches) and `ImagePrompt` (a rollout prompt with images).
- `rope`: the interleaved M-RoPE frequencies installed in megatron's rotary embedding.
- `tower`: transformers' own vision tower module, built from the checkpoint's vision_config.
- `model`: `VisionLanguageModel`, a megatron GPTModel whose first pipeline stage holds the
  tower and whose every stage rotates queries and keys by the batch's M-RoPE positions;
  `MTPVisionLanguageModel`: the same with the trained MTP layer (models.layers.mtp).

Which families take images is a family's declared `vision_prefix` (models.families.base).

May import: models.hf, models.families, models.families.base, models.layers (the MTP layer).
"""

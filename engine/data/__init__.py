"""Data: files and row units (files.py), chat-row checks (rows.py), chat-template rendering
(render.py), the per-node memory-mapped cache (cache.py), SFT datasets and the global batch
order (datasets.py), RL prompt rows (prompt_rows.py), rows with images (images.py; the cache's
image form, image_codec.py; the cached images and their references, image_store.py),
preference pairs for DPO and reward models (preference.py; rows, preference_rows.py; rendering,
preference_render.py), the chat template's delta after an assistant turn (observation.py: an
observation's ids, never re-tokenized sampled text) and the tool-call formats of the chat
families (tool_calls.py); TRL's SFT row formats (trl_rows.py); the rendered-sequence cache the pairs and unpaired examples share
(sequence_cache.py).

May import: engine.errors, models, parallel. Never imports config, training, checkpoint, run,
sft or rl. Entry points: datasets.load_sft_dataset, datasets.global_batch_indices,
prompt_rows.load_prompt_rows, preference.load_preference_dataset.
"""

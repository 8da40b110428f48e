"""Checkpoints: save/resume of model, optimizer, scheduler, RNG and data position at any layout
(checkpointing.py; per-rank RNG states: rng.py; the LR schedule of a resumed run,
checkpoint.schedule: schedule.py), the on-disk layout and its checks (io.py), the
asynchronous writer (writer.py), the HF folder of a model in memory that checkpoint.save_hf and
tools/convert.py mcore-to-hf both write (hf_export.py) and the save-point crash injection used
by the reliability tests (fault_injection.py).

May import: engine.errors, models, parallel. Entry points: checkpointing.save_training_checkpoint,
checkpointing.load_training_checkpoint, io.list_iterations.
"""

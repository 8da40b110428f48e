"""Checkpoints: save/resume of model, optimizer, scheduler, RNG and data position at any layout
(checkpointing.py), the on-disk layout and its checks (io.py), the asynchronous writer
(writer.py) and the save-point crash injection used by the reliability tests (fault_injection.py).

May import: engine.errors, models, parallel. Entry points: checkpointing.save_training_checkpoint,
checkpointing.load_training_checkpoint, io.list_iterations.
"""

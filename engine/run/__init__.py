"""The run loop around every optimizer step: metrics, progress, stop signals, saves and resume
(run_loop.py), and the metric writers (metrics.py: JSONL, TensorBoard, progress bar; the
experiment trackers W&B and MLflow: trackers.py, tracker_clients.py), and the launch every
training entry point runs once engine.cli parsed its command line (launch.py: validation,
process groups, megatron state, the header lines: header.py; the entry point's run by name).

May import: engine.config, engine.training, engine.checkpoint, engine.data (DataError),
engine.generation (the rollout settings' resolution), engine.errors, engine.cli. Never imports
sft or rl. Entry points: run_loop.RunLoop, launch.run_entry.
"""

"""The run loop around every optimizer step: metrics, progress, stop signals, saves and resume
(run_loop.py), and the metric writers (metrics.py: JSONL, TensorBoard, progress bar; the
experiment trackers W&B and MLflow: trackers.py, tracker_clients.py).

May import: engine.config, engine.training, engine.checkpoint, engine.errors. Never imports sft
or rl. Entry point: run_loop.RunLoop.
"""

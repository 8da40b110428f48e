"""Supervised fine-tuning: `python -m engine.sft` (__main__.py: parse and validate before any
process group exists) and the run itself (training.py: model, data, TrainEngine, RunLoop).

May import every other engine package; nothing imports it.
"""

"""The LR schedule of a resumed run (checkpoint.schedule): compare, then keep or rebuild.

A checkpoint stores megatron's OptimizerParamScheduler state (engine.checkpoint.checkpointing):
peak and final lr, warmup steps, decay steps and style, weight decay, and the steps done. A
resumed run whose optim.* keys or train.max_steps changed has a schedule that differs from it.
megatron's `load_state_dict` silently keeps the checkpoint's values (its
`use_checkpoint_opt_param_scheduler` default): a run resumed at 4 of 4 steps with
train.max_steps=8 trained steps 5-8 at the decayed optim.min_lr (0 by default), with only a
warning line among the resume messages. So `checkpoint.schedule` decides:

- `same` (default): a schedule that differs stops the run before anything is loaded
  (ResumeMismatchError naming each config key with both values);
- `checkpoint`: keep the checkpoint's schedule (megatron's behaviour; the differences are
  printed);
- `config`: the schedule the config built, advanced to the checkpoint's step count: the lr of
  step k equals a straight run's lr at step k under this config.
"""
from __future__ import annotations

SCHEDULE_CHOICES = ("same", "checkpoint", "config")


class ResumeMismatchError(ValueError):
    """A checkpoint that cannot continue this run (a different data stream or, under `same`, a
    different schedule); the message names the config keys and both values. Defined here, with
    no torch or megatron import, so the entry points catch it without loading the checkpoint
    code (engine.checkpoint.checkpointing raises it)."""

# scheduler state key -> (config key, what it is); several state keys can come from one
# config key (the weight-decay steps follow train.max_steps): a key is named once
_FIELDS = (
    ("max_lr", "optim.lr", "peak lr"),
    ("min_lr", "optim.min_lr", "final lr (optim.lr when optim.schedule=constant)"),
    ("lr_warmup_steps", "optim.warmup_steps", "warmup steps"),
    ("lr_decay_steps", "train.max_steps", "optimizer steps the schedule spans"),
    ("lr_decay_style", "optim.schedule", "decay style"),
    ("start_wd", "optim.weight_decay", "weight decay"),
    ("end_wd", "optim.weight_decay", "weight decay"),
    ("wd_incr_steps", "train.max_steps", "optimizer steps the schedule spans"),
    ("wd_incr_style", "optim.weight_decay", "weight decay style"),
)


# a span that sets no value while both schedules hold constant (the lr after warmup, the
# weight decay): a longer constant-lr run resumes as it is
_SPAN_OF_STYLE = {"lr_decay_steps": "lr_decay_style", "wd_incr_steps": "wd_incr_style"}


def schedule_differences(saved: dict, configured: dict) -> list[str]:
    """How the checkpoint's scheduler state `saved` differs from the scheduler this run's
    config built (`configured`, its state_dict()), one line per config key:
    "train.max_steps (optimizer steps the schedule spans): checkpoint 4, config 8". The
    step count (num_steps) is not compared: it is where the run stands, not its schedule;
    nor is the span of a part both hold constant (optim.schedule=constant with another
    train.max_steps: the same lr at every step)."""
    lines, named = [], set()
    for state_key, config_key, what in _FIELDS:
        if config_key in named or state_key not in saved or state_key not in configured:
            continue
        style = _SPAN_OF_STYLE.get(state_key)
        if style and saved.get(style) == configured.get(style) == "constant":
            continue
        if saved[state_key] != configured[state_key]:
            named.add(config_key)
            lines.append(f"{config_key} ({what}): checkpoint {saved[state_key]!r}, config "
                         f"{configured[state_key]!r}")
    return lines


def refusal(ckpt_dir, differences: list[str], step: int) -> str:
    """The message of a resume refused under checkpoint.schedule=same."""
    return (f"cannot resume from {ckpt_dir}: its LR schedule differs from this config's ("
            + "; ".join(differences) + "). Set checkpoint.schedule=config to rebuild the "
            f"schedule from the config at step {step} (the lr of every later step is a "
            "straight run's under this config), checkpoint.schedule=checkpoint to keep the "
            "checkpoint's, or restore those settings")


def resume_schedule(scheduler, saved: dict, mode: str) -> str | None:
    """Set `scheduler` (built from this run's config, at step 0) for a run resumed from a
    checkpoint whose scheduler state is `saved`, per checkpoint.schedule `mode` (a refusal
    under `same` happens before, in engine.checkpoint.checkpointing). Returns the line to
    print when the two schedules differ, else None."""
    if mode not in SCHEDULE_CHOICES:
        raise ValueError(f"checkpoint.schedule={mode!r} is not one of "
                         f"{', '.join(SCHEDULE_CHOICES)}")
    differences = schedule_differences(saved, scheduler.state_dict())
    if mode == "config":
        scheduler.step(increment=saved["num_steps"])
        return (f"the LR schedule is rebuilt from the config at step {saved['num_steps']} "
                "(checkpoint.schedule=config): " + "; ".join(differences)
                if differences else None)
    scheduler.load_state_dict(saved)
    return ("the LR schedule of the checkpoint is kept (checkpoint.schedule=checkpoint): "
            + "; ".join(differences) if differences else None)

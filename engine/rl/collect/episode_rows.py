"""An agent generation batch's trajectories regrouped by EPISODE for dynamic sampling (which
filters groups of rollout.n episodes, an episode holding several trained trajectories), and
back to one row per trajectory (engine.rl.collect.collector, env.agent)."""
from __future__ import annotations

import torch


def episode_rows(part: dict) -> dict:
    """An agent generation batch's trajectories as one row per EPISODE (group-major, as
    dynamic sampling filters them): "trajectories" (each episode's list of its trained
    trajectories' fields; empty for a failed episode) and "episode_rewards"."""
    data = part["data"]
    keys = [k for k in data if k != "episode"]
    per: list[list[dict]] = [[] for _ in range(len(part["episode_scores"]))]
    for t, e in enumerate(data["episode"]):
        per[e].append({k: data[k][t] for k in keys})
    return {"trajectories": per, "episode_rewards": part["episode_rewards"]}


def trajectory_rows(episodes: dict) -> dict:
    """The inverse of episode_rows on the kept episodes: one row per trajectory, "episode"
    renumbered over the kept episodes, "episode_rewards" theirs."""
    keys = {k for trajs in episodes["trajectories"] for t in trajs for k in t} | {
        "prompt_ids", "response_ids", "rollout_logprobs", "response_masks", "rewards",
        "scores", "dump_row"}
    data: dict = {k: [] for k in sorted(keys)}
    data["episode"] = []
    for e, trajs in enumerate(episodes["trajectories"]):
        for t in trajs:
            for k in keys:
                data[k].append(t[k])
            data["episode"].append(e)
    for k in ("rewards", "scores", "rm_scores"):
        if k in data:
            data[k] = torch.tensor([float(x) for x in data[k]], dtype=torch.float32)
    data["episode_rewards"] = episodes["episode_rewards"]
    return data

"""State files of the Tinker service written before the AdamW state became layout-independent
(engine.tinker.adapters' module docstring has today's form): read as today's."""
from __future__ import annotations


def legacy_optimizer(state: dict) -> dict:
    """An older state file (torch's optimizer.state_dict() under "optimizer", parameters in
    the adapter's key order) in today's layout-independent form ("adam", tinker.adapters)."""
    old = state.pop("optimizer", None)
    if "adam" in state or old is None:
        state.setdefault("adam", None)
        return state
    keys, moments = list(state["adapter"]), old["state"]
    state["adam"] = None if not moments else {
        "step": int(moments[0]["step"]),
        **{k: {key: moments[i][k] for i, key in enumerate(keys)}
           for k in ("exp_avg", "exp_avg_sq")}}
    return state

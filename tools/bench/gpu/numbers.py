"""Number formatting of the GPU report (tools.bench.gpu.report and its per-item parts)."""
from __future__ import annotations

import math


def finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def fmt(value, spec: str) -> str:
    """`value` formatted by `spec`, or "n/a" when it is not a finite number."""
    return "n/a" if not finite(value) else format(value, spec)

"""Which metric names docs/metrics.md documents: every name in backticks, where `<...>` stands
for any one path part (`env/<name>`, `val/<data_source>/pass@k`) and `@k` for any k. Used by
the tests that hold a real run's metrics.jsonl rows (tests/test_sft_cli.py,
tests/test_rl_async.py)."""
from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"


@lru_cache(maxsize=1)
def _patterns() -> tuple[re.Pattern, ...]:
    names = set(re.findall(r"`([A-Za-z0-9_./<>@-]+)`", DOC.read_text()))
    out = []
    for name in names:
        regex = re.escape(name).replace(r"@k", r"@\d+")
        regex = re.sub(r"<[^>]+>", "[^/]+", regex.replace(r"\<", "<").replace(r"\>", ">"))
        out.append(re.compile(regex + r"\Z"))
    return tuple(out)


def undocumented(keys) -> list[str]:
    """The keys (metric names of metrics.jsonl rows) that docs/metrics.md does not name."""
    return sorted(k for k in set(keys) if not any(p.match(k) for p in _patterns()))

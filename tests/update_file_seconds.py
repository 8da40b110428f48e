"""Write tests/file_seconds.json (the order in which the suite's xdist workers take the test
files, tests/conftest.py) from whole runs' JUnit XML (both tiers' runs: one file each): per
file, the sum of its testcases' `time` (setup, call and teardown), rounded to 0.1 s, longest
first.

    python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder tests --junitxml=/tmp/j.xml
    TESTS_TIER=second python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder tests \
        --junitxml=/tmp/j2.xml
    python tests/update_file_seconds.py /tmp/j.xml /tmp/j2.xml
"""
from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path


def file_seconds(*junit_xml: str) -> dict[str, float]:
    seconds: Counter = Counter()
    for path in junit_xml:
        for case in ET.parse(path).iter("testcase"):
            seconds[f"tests/{case.get('classname').split('.')[-1]}.py"] += float(case.get("time"))
    return {name: round(s, 1) for name, s in sorted(seconds.items(), key=lambda kv: -kv[1])}


if __name__ == "__main__":
    out = Path(__file__).with_name("file_seconds.json")
    out.write_text(json.dumps(file_seconds(*sys.argv[1:]), indent=1) + "\n")
    print(f"wrote {out}")

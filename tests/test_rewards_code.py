"""reward.fn=code: the fences, the test types, the tagged plain data, the three test formats on
correct and wrong solutions, and every hostile program contained by the bubblewrap sandbox
(engine.rl.rewards.sandbox) while the next item scores normally. The sandbox tests are skipped,
naming why, where the host cannot run bubblewrap. The known cheats:
tests/test_rewards_code_cheats.py; the sandbox's own boundaries: tests/test_sandbox_bwrap.py.
The formats and the cheats are judged outside the solution's process with or without
bubblewrap, so they run everywhere (without it: reward.code_sandbox=relaxed's runs)."""
from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from engine.rl.rewards import load_reward_fn, plain_data
from engine.rl.rewards.code import CodeReward, last_code_block, normalize_output
from engine.rl.rewards.code_tests import (AssertCalls, AssertScript, Call, CallTest, StdinTest,
                                          assert_calls, parse_tests)
from engine.rl.rewards.fences import fenced_blocks
from engine.rl.rewards.pool import RewardPool
from engine.rl.rewards.sandbox import missing_layers

ADD = [{"input": "1 2\n", "output": "3\n"}, {"input": "5 5", "output": "10"},
       {"input": "-4 1\n", "output": "-3  \n\n"}]
CALL = {"fn_name": "add", "inputs": [[1, 2], [3, 4], [0, 0]], "outputs": [3, [7], 0]}
NORMAL = ("```python\na, b = map(int, input().split())\nprint(a + b)\n```", {"tests": ADD})

needs_sandbox = pytest.mark.skipif(bool(missing_layers()),
                                   reason=f"sandbox layers missing: {missing_layers()}")


def block(code: str) -> str:
    return f"Let me write it.\n```python\n{code}\n```\nDone."


def marker_processes(marker: str) -> list[int]:
    """PIDs of the host's processes whose command line holds ``marker``."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and entry.name != str(os.getpid()):
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    out.append(int(entry.name))
            except OSError:
                pass
    return out


def wait_until_gone(marker: str, bound_s: float = 5.0) -> list[int]:
    """The processes of ``marker`` still alive once none are, or after ``bound_s`` seconds."""
    deadline = time.monotonic() + bound_s
    while marker_processes(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    return marker_processes(marker)


def test_block_extraction_and_output_normalisation():
    assert last_code_block("```py\nx=1\n```\ntext\n```python\ny=2\n```") == "y=2\n"
    assert last_code_block("no code") is None
    assert normalize_output("3  \r\n4\n\n\n") == normalize_output("3\n4") == "3\n4"
    assert normalize_output("3 4") != normalize_output("3  4")


@pytest.mark.parametrize("reply, expected", [
    # the review's two cases: a bash block before the solution (the old pattern paired the
    # bash block's closing fence with the python opening and gave ''), a bare sample-output
    # block after it (the old pattern took it as the solution)
    ("Run it with:\n```bash\npython sol.py < in.txt\n```\nThe code:\n```python\nprint(3)\n"
     "```\n", "print(3)\n"),
    ("```python\nprint(3)\n```\nSample output:\n```\n3\n```\n", "print(3)\n"),
    ("Only a bare block:\n```\nprint(1)\n```\n", "print(1)\n"),
    ("```Python3 title=x\nprint(1)\n```\n```py\nprint(2)\n```\n```js\nlet x\n```", "print(2)\n"),
    ("```javascript\nconsole.log(1)\n```\n", None),                  # another language only
    ("```python\nprint(1)\n", None),                                 # never closed (cut short)
    ("  ```python\n  def f():\n      return 1\n  ```\n", "def f():\n    return 1\n"),
    ("````python\n```\nprint('a fence inside')\n````\n", "```\nprint('a fence inside')\n"),
    ("~~~python\nprint(1)\n~~~\n", "print(1)\n"),
])
def test_fences_take_the_last_python_block_else_a_bare_one(reply, expected):
    assert last_code_block(reply) == expected


def test_fenced_blocks_are_line_based():
    blocks = fenced_blocks("a ```python inline``` b\n```bash\nls\n```\n```\nout\n```")
    assert [(b.language, b.content) for b in blocks] == [("bash", "ls\n"), ("", "out\n")]


def test_tests_have_types():
    assert parse_tests({"tests": ADD[:1]}) == [StdinTest("1 2\n", "3\n")]
    assert parse_tests({"tests": json.dumps({"inputs": ["1"], "outputs": ["2"]})}) == [
        StdinTest("1", "2")]
    assert parse_tests({"tests": CALL})[1] == CallTest("add", (3, 4), [7])
    assert parse_tests({"test_code": "assert sq(3) == 9\nassert not odd(x=2)"}) == [
        AssertCalls((Call("sq", (3,), {}, "eq", 9), Call("odd", (), {"x": 2}, "false")))]
    script = "x = sq(3)\nassert x == 9"
    assert parse_tests({"test_code": script}) == [AssertScript(script)]
    for bad, message in [({}, "no tests"), ({"fn_name": "f", "inputs": [1], "outputs": [1]},
                                            "must be a list of arguments"),
                         ({"fn_name": "f", "inputs": [[1]], "outputs": []}, "1 inputs but 0"),
                         ({"tests": [{"input": "1"}]}, r"tests\[0\]"),
                         ({"fn_name": "no such", "inputs": [[1]], "outputs": [1]}, "not a Python")]:
        with pytest.raises(ValueError, match=message):
            parse_tests(bad)


@pytest.mark.parametrize("script, calls", [
    ("assert f(1, [2, 3]) == (4, {5})", [Call("f", (1, [2, 3]), {}, "eq", (4, {5}))]),
    ("assert 9 == sq(-3), 'message'\nassert sq(0)", [Call("sq", (-3,), {}, "eq", 9),
                                                     Call("sq", (0,), {}, "true")]),
    ('METADATA = {"author": "x"}\n\ndef check(candidate):\n    """doc"""\n'
     "    assert candidate(2) == 4\n    assert not candidate(0)\n\ncheck(sq)\n",
     [Call("sq", (2,), {}, "eq", 4), Call("sq", (0,), {}, "false")]),
    ("from solution import sq\nassert sq(2) == 4", None),         # an import binds the name
    ("import math\nassert f(2) == 4", [Call("f", (2,), {}, "eq", 4)]),
    ("assert f(2) != 4", None),
    ("assert abs(f(2) - 4) < 1e-9", None),
    ("assert f(x) == 4", None),
    ("assert f(2) == float('inf')", None),
    ("for i in range(3):\n    assert f(i) == i", None),
    ("def check(c):\n    return c(1)\ncheck(f)", None),
    ("not python (", None),
])
def test_assert_scripts_of_calls_are_parsed_and_others_are_not(script, calls):
    assert assert_calls(script) == (tuple(calls) if calls is not None else None)


@pytest.mark.parametrize("value", [
    None, True, 0, -7, 2 ** 80, 1.5, float("inf"), -float("inf"), "é\n", b"\x00\xff",
    [1, (2, 3)], (), {1, 2}, frozenset({"a"}), {1: "a", (2, 3): [None], "$tuple": 4},
    {"nested": [{"deep": ({1.0},)}]},
])
def test_plain_data_round_trips_keeping_types(value):
    back = plain_data.loads(plain_data.dumps(value))
    assert back == value and type(back) is type(value)
    assert repr(back) == repr(value)


def test_plain_data_refuses_what_is_not_plain():
    nan = plain_data.loads(plain_data.dumps(float("nan")))
    assert math.isnan(nan)

    class Int(int):
        pass

    for value in (Int(3), object(), [1, {2: Int(1)}], 1j, print, (x for x in ())):
        with pytest.raises(plain_data.NotPlainData):
            plain_data.dumps(value)
    deep = []
    for _ in range(plain_data.MAX_DEPTH + 5):
        deep = [deep]
    with pytest.raises(plain_data.NotPlainData):
        plain_data.dumps(deep)
    for text in ('{"a": 1}', '{"$set": [[1]]}', '{"$nope": []}', "NaN", '{"$float": "1e999"}',
                 '{"$dict": [[1]]}', '{"$dict": [[[1], 2]]}', "[" * 5000 + "]" * 5000,
                 "9" * 5000):
        with pytest.raises(ValueError):
            plain_data.loads(text)


@pytest.mark.parametrize("code, fields, expected", [
    ("a, b = map(int, input().split())\nprint(a + b)", {"tests": ADD}, 1.0),
    ("a, b = map(int, input().split())\nprint(a * b if a == 5 else a + b)", {"tests": ADD},
     2 / 3),
    ("print(int(input().split()[0]))", {"tests": ADD}, 0.0),
    ("import sys\nsys.exit(0)", {"tests": ADD}, 0.0),                # ends early, prints nothing
    ("a, b = map(int, input().split())\nprint(a + b)\nraise SystemExit(1)", {"tests": ADD}, 0.0),
    ("def add(a, b):\n    return a + b", CALL, 1.0),
    ("def add(a, b):\n    return (a + b,)", CALL, 1 / 3),     # [7] is (7,) wrapped, as APPS
    ("class Solution:\n    def add(self, a, b):\n        return a + b", {"tests": CALL}, 1.0),
    ("def add(a, b):\n    return a - b", CALL, 1 / 3),
    ("def sq(x):\n    return x * x", {"test_code": "assert sq(3) == 9\nassert sq(-2) == 4"}, 1.0),
    ("def sq(x):\n    return x + x", {"test_code": "assert sq(3) == 9"}, 0.0),
    # the assert's own == semantics: a tuple is not a list, a set ignores order
    ("def f():\n    return (1, 2)", {"test_code": "assert f() == [1, 2]"}, 0.0),
    ("def f():\n    return {2, 1}", {"test_code": "assert f() == {1, 2}"}, 1.0),
    ("def f(n, k=0):\n    return {n: k}", {"test_code": "assert f(1, k=2) == {1: 2}"}, 1.0),
    # scripts the harness runs: solution functions called over the pipe
    ("def sq(x):\n    return x * x", {"test_code": "vals = [sq(v) for v in range(4)]\n"
                                                   "assert vals == [0, 1, 4, 9]"}, 1.0),
    ("def sq(x):\n    return x * x", {"test_code": "def check(candidate):\n"
                                                   "    assert abs(candidate(0.5) - 0.25) < 1e-9"
                                                   "\ncheck(sq)"}, 1.0),
    ("def inv(x):\n    if x == 0:\n        raise ValueError('zero')\n    return 1 / x",
     {"test_code": "try:\n    inv(0)\n    raise AssertionError\nexcept ValueError:\n    pass"},
     1.0),
    ("def sq(x):\n    return x * x", {"test_code": "x = sq(3)\nassert x == 10"}, 0.0),
    ("def sq(x):\n    return x * x", {"test_code": "x = sq(3)\nassert x == 9\n"
                                                   "raise SystemExit(0)\nassert False"}, 1.0),
    ("def sq(x):\n    return x * x", {"test_code": "x = sq(3)\nraise SystemExit(1)"}, 0.0),
    ("class P:\n    pass\ndef make():\n    return P()", {"test_code": "p = make()\nassert p"}, 0.0),
])
def test_formats_score_correct_and_wrong_solutions(code, fields, expected):
    assert load_reward_fn("code")("", block(code), "", **fields) == pytest.approx(expected)


def test_all_or_nothing_and_no_block_and_json_tests():
    partial = block("a, b = map(int, input().split())\nprint(a * b if a == 5 else a + b)")
    assert CodeReward(score="all")("", partial, "", tests=ADD) == 0.0
    assert CodeReward()("", "print(3)", "", tests=ADD) == 0.0    # no fenced block
    assert CodeReward()("", NORMAL[0], "", tests=json.dumps(ADD)) == 1.0
    with pytest.raises(ValueError, match="no tests"):
        CodeReward()("", NORMAL[0], "")


def accepting(server: socket.socket, address):
    """Yield `address` and the list of connections `server` (listening) accepts meanwhile, on
    a thread; close the server after."""
    server.listen()
    server.settimeout(0.2)
    hits, stop = [], threading.Event()

    def accept():
        while not stop.is_set():
            try:
                hits.append(server.accept())
            except OSError:
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield address, hits
    stop.set()
    thread.join()
    server.close()


@pytest.fixture(scope="module")
def listener():
    """A TCP port listening on the host's loopback; records whether anything connected."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    yield from accepting(server, server.getsockname()[1])


@needs_sandbox
def test_hostile_programs_are_contained_and_the_next_item_scores(tmp_path, listener,
                                                                monkeypatch):
    """Each hostile program scores 0 (its test fails) and leaves no trace; a normal item
    after each scores 1. All in the reward's worker pool, as a run scores them, with a run
    time limit of 4 s: the endless loop is a failed test, not a failed call."""
    port, hits = listener
    hits.clear()
    monkeypatch.setenv("TRAINER_SECRET", "hunter2")
    checkpoint = tmp_path / "checkpoints"
    checkpoint.mkdir()
    os.chmod(tmp_path, 0o755)
    marker = f"reward-sandbox-{uuid.uuid4().hex}"
    sleeper = ("os.execv(sys.executable, [sys.executable, '-c', 'import time; "
               f"time.sleep(600)', {marker!r}])")
    expect_secret = [{"input": "", "output": "hunter2"}]
    hostile = {
        "secret": ("import os\nprint(os.environ.get('TRAINER_SECRET'))", expect_secret),
        "write": (f"open({str(checkpoint / 'pwned')!r}, 'w').write('x')\nprint('ok')",
                  [{"input": "", "output": "ok"}]),
        "network": (f"import socket\nsocket.create_connection(('127.0.0.1', {port}), "
                    "timeout=2)\nprint('ok')", [{"input": "", "output": "ok"}]),
        # the first 3 sleepers carry the marker in their command line (an exec'd Python), the
        # others just sleep (cheap on a loaded host); all share one PID namespace
        "fork flood": ("import os, sys, time\nn = 0\nfor i in range(2000):\n    try:\n"
                       "        if os.fork() == 0:\n            if i < 3:\n"
                       f"                {sleeper}\n"
                       "            time.sleep(600)\n            os._exit(0)\n"
                       "        n += 1\n    except OSError:\n"
                       "        pass\nprint(n)", [{"input": "", "output": "2000"}]),
        "10 GB": ("x = bytearray(10 * 1024 ** 3)\nprint('ok')", [{"input": "", "output": "ok"}]),
        "1 GB out": ("import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(1024):\n"
                     "    sys.stdout.write(chunk)", [{"input": "", "output": "x"}]),
        "loop": ("while True:\n    pass", [{"input": "", "output": "ok"}]),
        "disk fill": ("for i in range(64):\n    open(f'f{i}', 'wb').write(b'x' * (15 << 20))\n"
                      "print('ok')", [{"input": "", "output": "ok"}]),
        "kill parent": ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n"
                        f"os.killpg({os.getpgid(0)}, signal.SIGKILL)\n"
                        "os.killpg(0, signal.SIGKILL)\nprint('ok')",
                        [{"input": "", "output": "ok"}]),
    }
    items = []
    for code, tests in hostile.values():
        items += [{"prompt": "", "response": block(code), "answer": "", "tests": tests},
                  {"prompt": "", "response": NORMAL[0], "answer": "", **NORMAL[1]}]
    pool = RewardPool(CodeReward(timeout_s=4.0), num_workers=2, timeout_s=4.0)
    try:
        report = pool.score(items)
    finally:
        pool.close()
    assert report.scores == [0.0, 1.0] * len(hostile), dict(zip(
        [k for k in hostile for _ in (0, 1)], report.scores))
    assert (report.errors, report.timeouts, report.failures) == (0, 0, 0)
    assert not (checkpoint / "pwned").exists()
    assert hits == []                        # nothing reached the host's loopback listener
    # every process of a killed run has SIGKILL when the call returns; the kernel ends them
    assert wait_until_gone(marker) == []     # no forked sleeper outlives its call
    assert not list(Path(tempfile.gettempdir()).glob("reward-code-*"))   # no host work dirs


def test_without_the_sandbox_the_same_programs_escape(tmp_path, listener, monkeypatch):
    """Negative control: the programs that the sandbox contains do read the secret, write the
    checkpoint folder and reach the listener when run plainly as the trainer's children."""
    port, hits = listener
    hits.clear()
    monkeypatch.setenv("TRAINER_SECRET", "hunter2")
    target = tmp_path / "pwned"
    code = (f"import os, socket\nprint(os.environ.get('TRAINER_SECRET'))\n"
            f"open({str(target)!r}, 'w').write('x')\n"
            f"socket.create_connection(('127.0.0.1', {port}), timeout=2)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "hunter2" and target.exists()
    deadline = time.monotonic() + 5
    while not hits and time.monotonic() < deadline:
        time.sleep(0.05)
    assert hits


def test_a_code_row_without_tests_is_refused_at_start_naming_file_line(qwen3_dir, tmp_path):
    """engine.rl.collect.prompts.prompt_rows, before the model is built: reward.fn=code refuses
    the first row whose tests cannot be read, by file:line; other rewards take the rows."""
    from transformers import AutoTokenizer   # heavy: only this test needs it

    from engine.config.schema import load_config
    from engine.data.files import DataError
    from engine.rl.collect.prompts import prompt_rows
    from engine.rl.config import RLConfig

    path = tmp_path / "code.jsonl"
    path.write_text(json.dumps({"prompt": "add", "answer": "", "tests": ADD}) + "\n"
                    + json.dumps({"prompt": "no tests", "answer": ""}) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(qwen3_dir)
    args = [f"model.hf_path={qwen3_dir}", f"data.cache_dir={tmp_path / 'cache'}"]
    code, _ = load_config(RLConfig, args + ["reward.fn=code"])
    with pytest.raises(DataError, match=f"^{path}:2: reward.fn=code: the row has no tests"):
        prompt_rows(code, tokenizer, [str(path)])
    other, _ = load_config(RLConfig, args + ["reward.fn=math"])
    assert len(prompt_rows(other, tokenizer, [str(path)])[0]) == 2

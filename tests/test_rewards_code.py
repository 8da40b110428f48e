"""reward.fn=code: the three test formats on correct and wrong solutions, and every hostile
program contained by the sandbox (engine.rl.rewards.sandbox) while the next item scores
normally. The sandbox needs its layers (unshare, root for the uid switch): the hostile tests are
skipped, naming the missing layers, where the host cannot enforce them."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from engine.rl.rewards import load_reward_fn
from engine.rl.rewards.code import CodeReward, last_code_block, normalize_output
from engine.rl.rewards.pool import RewardPool
from engine.rl.rewards.sandbox import RUN_UIDS, missing_layers

ADD = [{"input": "1 2\n", "output": "3\n"}, {"input": "5 5", "output": "10"},
       {"input": "-4 1\n", "output": "-3  \n\n"}]
CALL = {"fn_name": "add", "inputs": [[1, 2], [3, 4], [0, 0]], "outputs": [3, [7], 0]}
NORMAL = ("```python\na, b = map(int, input().split())\nprint(a + b)\n```", {"tests": ADD})

needs_sandbox = pytest.mark.skipif(bool(missing_layers()),
                                   reason=f"sandbox layers missing: {missing_layers()}")


def block(code: str) -> str:
    return f"Let me write it.\n```python\n{code}\n```\nDone."


def test_block_extraction_and_output_normalisation():
    assert last_code_block("```py\nx=1\n```\ntext\n```python\ny=2\n```") == "y=2\n"
    assert last_code_block("no code") is None
    assert normalize_output("3  \r\n4\n\n\n") == normalize_output("3\n4") == "3\n4"
    assert normalize_output("3 4") != normalize_output("3  4")


@pytest.mark.parametrize("code, fields, expected", [
    ("a, b = map(int, input().split())\nprint(a + b)", {"tests": ADD}, 1.0),
    ("a, b = map(int, input().split())\nprint(a * b if a == 5 else a + b)", {"tests": ADD},
     2 / 3),
    ("print(int(input().split()[0]))", {"tests": ADD}, 0.0),
    ("def add(a, b):\n    return a + b", CALL, 1.0),
    ("class Solution:\n    def add(self, a, b):\n        return a + b", {"tests": CALL}, 1.0),
    ("def add(a, b):\n    return a - b", CALL, 1 / 3),
    ("def sq(x):\n    return x * x", {"test_code": "assert sq(3) == 9\nassert sq(-2) == 4"}, 1.0),
    ("def sq(x):\n    return x + x", {"test_code": "assert sq(3) == 9"}, 0.0),
])
def test_formats_score_correct_and_wrong_solutions(code, fields, expected):
    assert load_reward_fn("code")("", block(code), "", **fields) == pytest.approx(expected)


def test_all_or_nothing_and_no_block_and_json_tests():
    partial = block("a, b = map(int, input().split())\nprint(a * b if a == 5 else a + b)")
    assert CodeReward(score="all")("", partial, "", tests=ADD) == 0.0
    assert CodeReward()("", "print(3)", "", tests=ADD) == 0.0    # no fenced block
    import json   # the JSON text form of the tests
    assert CodeReward()("", NORMAL[0], "", tests=json.dumps(ADD)) == 1.0
    with pytest.raises(ValueError, match="no tests"):
        CodeReward()("", NORMAL[0], "")


def _sandbox_uid_processes() -> list[str]:
    """Processes of any sandbox uid (RUN_UIDS) alive on the host."""
    out = subprocess.run(["ps", "-eo", "uid=,pid=,cmd="], capture_output=True,
                         text=True).stdout
    return [line for line in out.splitlines() if int(line.split()[0]) in RUN_UIDS]


@pytest.fixture(scope="module")
def listener():
    """A TCP port listening on the host's loopback; records whether anything connected."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
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
    yield server.getsockname()[1], hits
    stop.set()
    thread.join()
    server.close()


@needs_sandbox
def test_hostile_programs_are_contained_and_the_next_item_scores(tmp_path, listener,
                                                                monkeypatch):
    """Each hostile program scores 0 (its test fails) and leaves no trace; a normal item
    after each scores 1. All in the reward's worker pool, as a run scores them."""
    port, hits = listener
    hits.clear()
    monkeypatch.setenv("TRAINER_SECRET", "hunter2")
    checkpoint = tmp_path / "checkpoints"
    checkpoint.mkdir()
    os.chmod(tmp_path, 0o755)   # a folder the sandbox uid could at least find
    expect_secret = [{"input": "", "output": "hunter2"}]
    hostile = {
        "secret": ("import os\nprint(os.environ.get('TRAINER_SECRET'))", expect_secret),
        "write": (f"open({str(checkpoint / 'pwned')!r}, 'w').write('x')\nprint('ok')",
                  [{"input": "", "output": "ok"}]),
        "network": (f"import socket\nsocket.create_connection(('127.0.0.1', {port}), "
                    "timeout=2)\nprint('ok')", [{"input": "", "output": "ok"}]),
        "fork flood": ("import os, time\nn = 0\nfor _ in range(2000):\n    try:\n"
                       "        if os.fork() == 0:\n            time.sleep(600)\n"
                       "            os._exit(0)\n        n += 1\n    except OSError:\n"
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
        t0 = time.monotonic()
        report = pool.score(items)
        elapsed = time.monotonic() - t0
    finally:
        pool.close()
    assert report.scores == [0.0, 1.0] * len(hostile), dict(zip(
        [k for k in hostile for _ in (0, 1)], report.scores))
    assert (report.errors, report.timeouts, report.failures) == (0, 0, 0)
    assert not (checkpoint / "pwned").exists()
    assert hits == []                        # nothing reached the host's loopback listener
    assert _sandbox_uid_processes() == []    # no forked sleeper outlives its call
    assert not list(Path(tempfile.gettempdir()).glob("reward-code-*"))   # work dirs removed
    assert elapsed < 120


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


def test_strict_refuses_a_missing_layer_by_name_and_relaxed_runs(monkeypatch):
    from engine.rl.config import RewardConfig   # torch: kept out of the workers' import
    import engine.rl.rewards.settings as settings
    monkeypatch.setattr(settings, "missing_layers", lambda: {"netns": "unshare failed"})
    (problem,) = settings.reward_settings_problems(RewardConfig(fn="code"))
    assert "reward.code_sandbox=strict" in problem and "netns: unshare failed" in problem
    assert "reward.code_sandbox=relaxed" in problem
    assert settings.reward_settings_problems(RewardConfig(fn="code",
                                                          code_sandbox="relaxed")) == []
    assert settings.reward_settings_problems(RewardConfig(fn="math")) == []

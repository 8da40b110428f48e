"""The code sandbox on bubblewrap (engine.rl.rewards.sandbox, engine.rl.rewards.bwrap): what a
program sees (an empty root: no dataset, no project, no host /etc), where its writes go (nowhere
on the host), what it reaches (no unix socket outside), that it never outlives a killed scoring
worker, and the strict/relaxed settings. The same programs run without bubblewrap
(reward.code_sandbox=relaxed) are the negative controls: there they do reach the host."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import tempfile
import time
import uuid
from pathlib import Path

import pytest

import engine.rl.rewards.sandbox as sandbox
from engine.rl.rewards import bwrap
from engine.rl.rewards.code import CodeReward
from engine.rl.rewards.pool import RewardPool
from tests.test_rewards_code import accepting, block, marker_processes, wait_until_gone

ENGINE_ROOT = Path(__file__).resolve().parents[1]
needs_sandbox = pytest.mark.skipif(bool(sandbox.missing_layers()),
                                   reason=f"sandbox layers missing: {sandbox.missing_layers()}")


@pytest.fixture
def host_folder():
    """A world-readable folder outside /tmp and /var/tmp (/run, as D-Bus's socket, where the
    trainer may write there), removed afterwards."""
    base = next(b for b in ("/run", "/var/lib", str(ENGINE_ROOT)) if os.access(b, os.W_OK))
    folder = Path(tempfile.mkdtemp(dir=base, prefix="reward-sandbox-test-"))
    os.chmod(folder, 0o755)
    yield folder
    shutil.rmtree(folder)


@pytest.fixture
def relaxed(monkeypatch):
    """reward.code_sandbox=relaxed on a host without bubblewrap: the runs go without it."""
    monkeypatch.setattr(sandbox, "missing_layers", lambda: {"bubblewrap": "not installed"})


@needs_sandbox
def test_the_root_holds_only_the_interpreter_libraries_devices_and_work():
    hidden = bwrap.interpreter().hidden
    probe = ("import ctypes, json, os, sys\n"
             "def can(name):\n    try:\n        __import__(name)\n        return True\n"
             "    except ImportError:\n        return False\n"
             "def chroot():\n    try:\n        os.chroot('/work')\n        return True\n"
             "    except OSError:\n        return False\n"
             "userns = ctypes.CDLL(None, use_errno=True).unshare(0x10000000) == 0\n"
             "print(json.dumps({'root': sorted(os.listdir('/')), 'dev': sorted(os.listdir('/dev')),"
             " 'work': sorted(os.listdir('.')), 'cwd': os.getcwd(), 'uid': os.getuid(),"
             " 'gid': os.getgid(), 'env': dict(os.environ), 'path': sys.path,"
             " 'site': [can(m) for m in ('engine', 'torch', 'pytest')], 'chroot': chroot(),"
             f" 'userns': userns, 'hidden': [os.listdir(p) for p in {list(hidden)!r}]}}))")
    result = sandbox.run_program({"solution.py": probe}, "main", b"", 30)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    python = bwrap.interpreter()
    tops = {p.split("/")[1] for p in (*bwrap.LIB_DIRS, *python.binds)}
    assert set(seen["root"]) <= tops | {"dev", "work"}
    assert not {"etc", "proc", "tmp", "run", "var", "home", "sys"} & set(seen["root"])
    assert seen["dev"] == ["null", "urandom", "zero"]
    assert (seen["cwd"], seen["uid"], seen["gid"]) == ("/work", 65534, 65534)
    # bwrap's --chdir sets PWD, Python's C-locale coercion LC_CTYPE: nothing of the trainer
    assert set(seen["env"]) <= {"PWD", "LC_CTYPE"}
    assert set(seen["work"]) == {"solution.py", "runner.py", "plain_data.py"}
    assert seen["site"] == [False, False, False]
    assert seen["hidden"] == [[] for _ in hidden]     # site-packages folders: empty
    assert (seen["chroot"], seen["userns"]) == (False, False)   # no capability, no new userns
    assert not [p for p in seen["path"] if "-packages" in p]


def _probe_items(folder: Path, marker: str, socket_path: str) -> dict[str, tuple[str, str]]:
    """name -> (program, the output it prints when it got through)."""
    dataset = folder / "train.jsonl"   # the trainer's dataset: root-owned, 0644
    dataset.write_text(json.dumps({"prompt": "add", "answer": "", "tests": [
        {"input": "20 22\n", "output": "42\n"}]}) + "\n")
    os.chmod(dataset, 0o644)
    dirs = ["/run/lock", "/var/tmp", "/var/lock", "/dev/shm", "/tmp"]
    return {
        # the review's cheat: find its own stdin among the dataset's rows, print the answer
        "dataset": ("import json, sys\ngiven = sys.stdin.read()\n"
                    f"for line in open({str(dataset)!r}):\n"
                    "    for t in json.loads(line)['tests']:\n"
                    "        if t['input'] == given:\n            print(t['output'])", "42"),
        "project": (f"print(len(open({str(ENGINE_ROOT / 'engine/rl/rewards/code.py')!r}).read())"
                    " > 0)", "True"),
        "etc": ("print(open('/etc/passwd').read().split(':')[0])", "root"),
        "writes": ("import os\nn = 0\n"
                   f"for d in {dirs!r}:\n    try:\n"
                   f"        open(os.path.join(d, {marker!r}), 'w').write('x')\n"
                   "        n += 1\n    except OSError:\n        pass\nprint(n)", str(len(dirs))),
        "unix socket": ("import socket\ns = socket.socket(socket.AF_UNIX)\n"
                        f"s.connect({socket_path!r})\ns.sendall(b'hello')\nprint('sent')", "sent"),
    }


@pytest.fixture
def unix_listener(host_folder):
    """A world-writable unix socket in a folder outside /tmp (as D-Bus's), with the
    connections it accepted."""
    path = str(host_folder / "bus")
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    os.chmod(path, 0o777)
    yield from accepting(server, path)


def _score(name: str, programs: dict, reward: CodeReward) -> float:
    code, printed = programs[name]
    given = "20 22\n" if name == "dataset" else ""
    return reward("", block(code), "", tests=[{"input": given, "output": printed}])


def _written(marker: str) -> list[str]:
    paths = {os.path.realpath(f"{d}/{marker}")
             for d in ("/run/lock", "/var/tmp", "/var/lock", "/dev/shm", "/tmp")}
    return sorted(p for p in paths if os.path.exists(p))


@needs_sandbox
@pytest.mark.parametrize("name", ["dataset", "project", "etc", "writes", "unix socket"])
def test_programs_find_nothing_of_the_host_and_leave_nothing(name, host_folder, unix_listener):
    path, hits = unix_listener
    marker = f"reward-sandbox-{uuid.uuid4().hex}"
    programs = _probe_items(host_folder, marker, path)
    assert _score(name, programs, CodeReward(timeout_s=30.0)) == 0.0
    assert _written(marker) == [] and hits == []


def test_without_bubblewrap_the_same_programs_reach_the_host(host_folder, unix_listener,
                                                            relaxed):
    """Negative control (reward.code_sandbox=relaxed): each program of the test above gets
    through when bubblewrap is not there (as root: the writes of a non-root trainer to
    /run/lock may fail, so only where the trainer may write)."""
    path, hits = unix_listener
    marker = f"reward-sandbox-{uuid.uuid4().hex}"
    programs = _probe_items(host_folder, marker, path)
    reward = CodeReward(timeout_s=30.0)
    try:
        for name in ("dataset", "project", "etc", "unix socket"):
            assert _score(name, programs, reward) == 1.0, name
        _score("writes", programs, reward)
        assert _written(marker)
    finally:
        for leftover in _written(marker):
            os.unlink(leftover)
    deadline = time.monotonic() + 5
    while not hits and time.monotonic() < deadline:
        time.sleep(0.05)
    assert hits


@needs_sandbox
def test_killing_the_scoring_worker_ends_every_program_process():
    """The pool's worker is SIGKILLed while its program and the program's forked children
    run: 5 s later no process of that program is alive (bwrap --die-with-parent: the PID
    namespace's init dies with bwrap, and the kernel ends the namespace)."""
    marker = f"reward-sandbox-{uuid.uuid4().hex}"
    program = ("import os, sys\nfor _ in range(3):\n    if os.fork() == 0:\n"
               "        os.execv(sys.executable, [sys.executable, '-c', 'while True: pass', "
               f"{marker!r}])\n"
               f"os.execv(sys.executable, [sys.executable, '-c', 'while True: pass', {marker!r}])")
    pool = RewardPool(CodeReward(timeout_s=120.0), num_workers=1, timeout_s=120.0)
    try:
        pool.submit("hostile", {"prompt": "", "response": block(program), "answer": "",
                                "tests": [{"input": "", "output": "ok"}]})
        deadline = time.monotonic() + 60
        while len(marker_processes(marker)) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(marker_processes(marker)) == 4
        os.kill(pool.workers[0].proc.pid, signal.SIGKILL)
        assert wait_until_gone(marker, 5.0) == []
    finally:
        pool.close()


def test_strict_refuses_without_bubblewrap_naming_the_package(monkeypatch):
    from engine.rl.config import RewardConfig   # torch: kept out of the workers' import
    import engine.rl.rewards.settings as settings
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    missing = sandbox.missing_layers.__wrapped__()
    assert list(missing) == ["bubblewrap"] and "install the package bubblewrap" in missing[
        "bubblewrap"]
    monkeypatch.setattr(settings, "missing_layers", lambda: missing)
    (problem,) = settings.reward_settings_problems(RewardConfig(fn="code"))
    assert "reward.code_sandbox=strict" in problem and "bubblewrap" in problem
    assert "reward.code_sandbox=relaxed" in problem
    assert settings.reward_settings_problems(RewardConfig(fn="code",
                                                          code_sandbox="relaxed")) == []
    assert settings.reward_settings_problems(RewardConfig(fn="math")) == []


def test_relaxed_runs_without_bubblewrap_and_still_judges_outside(relaxed):
    assert "missing: bubblewrap" in sandbox.describe()
    before = set(Path(tempfile.gettempdir()).glob("reward-code-*"))
    right = block("def sq(x):\n    return x * x")
    cheat = block("def sq(x):\n    return 0\nimport os\nos._exit(0)")
    for test_code in ("assert sq(3) == 9", "x = sq(3)\nassert x == 9"):
        assert CodeReward()("", right, "", test_code=test_code) == 1.0
        assert CodeReward()("", cheat, "", test_code=test_code) == 0.0
    assert set(Path(tempfile.gettempdir()).glob("reward-code-*")) <= before   # removed

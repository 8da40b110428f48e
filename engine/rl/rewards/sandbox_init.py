"""The first process inside a code sandbox (engine.rl.rewards.sandbox), run as a script:
``python -I -S sandbox_init.py SPEC_JSON``. Standard library only; it imports nothing of the
engine (it runs before the privileges drop, with an empty environment).

SPEC_JSON: {"argv": the program's argv, "rlimits": {name: value}, "uid": int or null,
"private_tmp": bool}. In order: tmpfs over /tmp, /var/tmp and /dev/shm when private_tmp (the
working directory's files, from the current one, are copied into /tmp/work on that tmpfs, the
new cwd); the rlimits; the groups, gid and uid dropped to `uid` when given; then the program
is forked and waited for, and this process exits with its status. In a PID namespace this
process is its init: when it exits, the kernel kills every process left in the namespace (a
program's forked children included).
"""
import json
import os
import resource
import subprocess
import sys

TMP_DIRS = ("/tmp", "/var/tmp", "/dev/shm")
TMP_SIZE = "64m"


def _mount(*args: str) -> None:
    """mount(8) with `args`; raises if it fails."""
    subprocess.run(["mount", *args], check=True, env={"PATH": "/usr/bin:/bin:/usr/sbin:/sbin"})


def _private_tmp(uid) -> None:
    """tmpfs over TMP_DIRS, then the working directory's files copied into /tmp/work (on that
    size-bounded tmpfs, gone with the namespace), which becomes the cwd: the program never
    writes to the host's disk."""
    work = os.open(".", os.O_RDONLY | os.O_DIRECTORY)
    for path in TMP_DIRS:
        if os.path.isdir(path):
            _mount("-t", "tmpfs", "-o", f"size={TMP_SIZE},mode=1777", "tmpfs", path)
    os.mkdir("/tmp/work", 0o700)
    for name in os.listdir(work):
        src = os.open(name, os.O_RDONLY, dir_fd=work)
        with os.fdopen(src, "rb") as f, open(f"/tmp/work/{name}", "wb") as out:
            out.write(f.read())
        if uid is not None:
            os.chown(f"/tmp/work/{name}", uid, uid)
    if uid is not None:
        os.chown("/tmp/work", uid, uid)
    os.close(work)
    os.chdir("/tmp/work")


def _limit(rlimits: dict) -> None:
    for name, value in rlimits.items():
        resource.setrlimit(getattr(resource, name), (value, value))


def main() -> int:
    spec = json.loads(sys.argv[1])
    if spec.get("private_tmp"):
        _private_tmp(spec.get("uid"))
    _limit(spec["rlimits"])
    uid = spec.get("uid")
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    pid = os.fork()
    if pid == 0:
        try:
            os.execve(spec["argv"][0], spec["argv"], {})
        finally:
            os._exit(127)
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except ChildProcessError:
            return 1
        except InterruptedError:
            continue
    return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


if __name__ == "__main__":
    sys.exit(main())

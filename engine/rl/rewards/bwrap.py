"""The bubblewrap (`bwrap`) command of a code sandbox (engine.rl.rewards.sandbox), and the
Python interpreter it runs.

The program's root is an empty, read-only tmpfs holding only:

- read-only binds of the shared-library folders (/usr/lib, /usr/lib64; /lib and /lib64 as the
  host has them, symlinks kept as symlinks) and of the interpreter: its executable and, when its
  prefix is not /usr, the prefix's ``lib`` folder (libpython, the standard library), each
  site-packages folder inside a bound one hidden under an empty read-only tmpfs;
- /dev holding only null, zero and urandom;
- /work: a private tmpfs of WORK_BYTES holding the run's files (copied in from memory; nothing
  of the host's disk), the working directory.

No /proc, /tmp, /run, /var, /home, /etc; every namespace unshared (user, mount, PID, network,
IPC, UTS, cgroup) and no further user namespace; uid and gid 65534 inside, no capability; a new
session; it dies with the process that started it (SIGKILL). As root, bwrap itself runs as uid
RUN_UID (set by subprocess between fork and exec, no Python code there), because RLIMIT_NPROC
is not enforced for host uid 0: the program's processes then count against its own user
namespace's limit (one run's flood never starves another run). The interpreter must be one
RUN_UID can execute: the trainer's own, else the system ``python3``.
"""
from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

RUN_UID = 65534
WORK = "/work"
WORK_BYTES = 64 << 20
LIB_DIRS = ("/usr/lib", "/usr/lib64", "/lib", "/lib64")
DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom")
INSTALL_HINT = ("install the package bubblewrap (apt-get install bubblewrap, dnf install "
                "bubblewrap or pacman -S bubblewrap; `bash tools/install.sh` as root does it)")
FLAGS = ("--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
         "--new-session", "--cap-drop", "ALL", "--uid", str(RUN_UID), "--gid", str(RUN_UID),
         "--clearenv")
_INFO = ("import json, os, sys, sysconfig, site; print(json.dumps({'executable': "
         "os.path.realpath(sys.executable), 'prefix': sys.base_prefix, 'exec_prefix': "
         "sys.base_exec_prefix, 'site': site.getsitepackages() + [sysconfig.get_path(k) for k "
         "in ('purelib', 'platlib')], 'version': sys.version.split()[0]}))")


@dataclass(frozen=True)
class Interpreter:
    """A Python the sandbox runs: its executable, what to bind read-only, what to hide."""
    executable: str
    version: str
    binds: tuple[str, ...]
    hidden: tuple[str, ...]


def run_user() -> dict:
    """Popen's keywords that run a sandbox as RUN_UID when the trainer is root (none else)."""
    if os.geteuid() != 0:
        return {}
    return {"user": RUN_UID, "group": RUN_UID, "extra_groups": []}


def _under(path: str, folders) -> bool:
    return any(path == f or path.startswith(f.rstrip("/") + "/") for f in folders)


def _describe(candidate: str) -> Interpreter | None:
    """The Interpreter of ``candidate`` when RUN_UID (or the trainer) can run it, else None."""
    try:
        done = subprocess.run([os.path.realpath(candidate), "-I", "-S", "-c", _INFO], env={},
                              cwd="/", capture_output=True, timeout=60, **run_user())
        info = json.loads(done.stdout)
    except (OSError, ValueError, subprocess.SubprocessError):
        return None
    libs = [d for d in LIB_DIRS if os.path.isdir(d)]
    binds = [info["executable"]]
    for prefix in dict.fromkeys([info["prefix"], info["exec_prefix"]]):
        lib = os.path.join(prefix, "lib")
        if os.path.isdir(lib) and not _under(lib, libs) and not _under(lib, binds):
            binds.append(lib)
    hidden = [s for s in dict.fromkeys(info["site"])
              if s and os.path.isdir(s) and _under(s, libs + binds)]
    return Interpreter(info["executable"], info["version"], tuple(binds), tuple(hidden))


@functools.lru_cache(maxsize=None)
def interpreter() -> Interpreter | None:
    """The first of this interpreter, /usr/bin/python3, /usr/local/bin/python3 that the
    sandbox's uid can run (cached); None when none can."""
    for candidate in dict.fromkeys([sys.executable, "/usr/bin/python3",
                                    "/usr/local/bin/python3"]):
        if os.path.exists(candidate):
            found = _describe(candidate)
            if found is not None:
                return found
    return None


def command(python: Interpreter, files: dict[str, int], argv: list[str]) -> list[str]:
    """The bwrap command running ``argv`` (after the interpreter's path) in /work, holding
    ``files`` (name -> the fd of its content, read by bwrap; pass them to Popen)."""
    cmd = [shutil.which("bwrap") or "bwrap", *FLAGS]
    for folder in LIB_DIRS:
        if os.path.islink(folder):
            cmd += ["--symlink", os.readlink(folder), folder]
        elif os.path.isdir(folder):
            cmd += ["--ro-bind", folder, folder]
    for path in python.binds:
        cmd += ["--ro-bind", path, path]
    for path in python.hidden:
        cmd += ["--size", "4096", "--tmpfs", path, "--remount-ro", path]
    cmd += ["--dir", "/dev"]
    for device in DEVICES:
        cmd += ["--dev-bind", device, device]
    cmd += ["--size", str(WORK_BYTES), "--tmpfs", WORK]
    for name, fd in files.items():
        cmd += ["--ro-bind-data", str(fd), f"{WORK}/{name}"]
    cmd += ["--chdir", WORK, "--remount-ro", "/", python.executable, *argv]
    return cmd

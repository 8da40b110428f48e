"""The program a code sandbox runs (engine.rl.rewards.sandbox): ``python -I -S runner.py SPEC``,
in a working directory holding ``runner.py`` (this file), ``plain_data.py`` and the mode's
files. Standard library only, no import of the engine (it runs in the sandbox, under whichever
Python 3 the sandbox has).

SPEC is JSON: ``{"mode": ..., "rlimits": {"RLIMIT_CPU": n, ...}}`` (plus the mode's keys). The
rlimits are set first, soft = hard (RLIMIT_CPU's hard one a second later, so SIGXCPU comes
first and SIGKILL follows), before any code of the row or the reply runs, so none of it can
raise them. Modes:

- ``main``: ``solution.py`` runs as ``__main__`` (stdin/stdout tests); its exit status and
  output are the scorer's to judge.
- ``calls``: ``solution.py`` is loaded as the module ``solution``; the calls read as JSON from
  stdin (``[[name, args, kwargs], ...]``, arguments in plain_data's tagged form) run in order,
  each a module function, else a method of ``solution.Solution()``; one line per call is
  written to the original stdout: ``{"ok": tagged result}`` or ``{"error": "..."}``. The
  solution's own prints go to stderr. The verdict is the scorer's: it compares the results.
- ``serve``: the solution's side of an assert script's harness: loads ``solution.py``, writes
  ``{"names": [its top-level callables]}`` (or ``{"error": ...}``) to stdout, then answers
  each request line ``[name, args, kwargs]`` of stdin with ``{"ok": ...}``, ``{"raise":
  [exception class name, message]}`` or ``{"error": ...}`` until EOF.
- ``harness`` (keys ``requests``, ``responses``: fd numbers; ``line_bytes``): trusted, in a
  sandbox of its own: runs ``test_code.py`` with every name the solution serves, except the
  names of builtins, bound to a proxy (also as attributes of a module ``solution``) that calls
  it over the pipes and returns the decoded plain-data result (an ``Exception`` subclass of
  builtins the solution raised is raised again by name, any other failure as SolutionError).
  Writes ``pass`` to its original stdout when the test code ran to its end (or raised
  SystemExit with status 0 or None), else ``fail: why``.
"""
import builtins
import importlib
import json
import os
import resource
import sys

CALL_LIMIT = 100000   # the recursion limit of the solution's calls (as the public harnesses)


class SolutionError(Exception):
    """A call of the solution that failed in a way its own exception cannot say (harness)."""


def _limit(rlimits):
    for name, value in rlimits.items():
        hard = value + 1 if name == "RLIMIT_CPU" else value
        resource.setrlimit(getattr(resource, name), (value, hard))


def _private_stdout():
    """The original stdout as a text stream of this runner's own; fd 1 then points at stderr,
    so whatever the solution or the test code prints never mixes into the protocol."""
    out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def _source(name):
    with open(name, encoding="utf-8") as f:
        return compile(f.read(), name, "exec")


def _load_solution():
    """solution.py executed as the module ``solution``."""
    module = type(sys)("solution")
    module.__file__ = os.path.abspath("solution.py")
    sys.modules["solution"] = module
    exec(_source("solution.py"), module.__dict__)
    return module


def _function(module, name):
    fn = getattr(module, name, None)
    if fn is None and hasattr(module, "Solution"):
        fn = getattr(module.Solution(), name)
    if not callable(fn):
        raise AttributeError(f"the solution has no function {name!r}")
    return fn


def _call(plain_data, module, request):
    """One request's answer line (a dict)."""
    name, args, kwargs = request
    try:
        fn = _function(module, name)
        result = fn(*plain_data.decode(args), **plain_data.decode(kwargs))
    except Exception as e:
        return {"raise": [type(e).__name__, str(e)[:1000]]}
    except BaseException as e:   # SystemExit and the like: never raised again in the harness
        return {"error": f"{type(e).__name__}: {str(e)[:1000]}"}
    try:
        return {"ok": plain_data.encode(result)}
    except (plain_data.NotPlainData, RecursionError) as e:
        return {"error": f"the result is not plain data: {e}"}


def _send(out, message):
    try:
        line = json.dumps(message, allow_nan=False, separators=(",", ":"))
    except (ValueError, RecursionError) as e:
        line = json.dumps({"error": f"the result cannot be written: {e}"})
    out.write(line + "\n")
    out.flush()


def _calls(plain_data):
    requests = json.loads(sys.stdin.read())
    out = _private_stdout()
    sys.setrecursionlimit(CALL_LIMIT)
    module = _load_solution()
    for request in requests:
        _send(out, _call(plain_data, module, request))
    out.close()


def _serve(plain_data):
    out = _private_stdout()
    try:
        sys.setrecursionlimit(CALL_LIMIT)
        module = _load_solution()
    except BaseException as e:
        _send(out, {"error": f"the solution failed to load: {type(e).__name__}: {e}"})
        return
    names = [n for n, v in vars(module).items()
             if callable(v) and not n.startswith("__") and not isinstance(v, type(sys))]
    _send(out, {"names": names})
    for line in sys.stdin:
        _send(out, _call(plain_data, module, json.loads(line)))


def _proxy(plain_data, name, requests, responses, line_bytes):
    def call(*args, **kwargs):
        requests.write(json.dumps([name, plain_data.encode(list(args)),
                                   plain_data.encode(dict(kwargs))]) + "\n")
        requests.flush()
        line = responses.readline(line_bytes + 1)
        if not line.endswith("\n"):
            raise SolutionError(f"{name}: the solution gave no answer")
        answer = json.loads(line)
        if "ok" in answer:
            return plain_data.decode(answer["ok"])
        if "raise" in answer:
            kind, message = answer["raise"]
            cls = getattr(builtins, str(kind), None)
            if isinstance(cls, type) and issubclass(cls, Exception):
                raise cls(message)
            raise SolutionError(f"{name} raised {kind}: {message}")
        raise SolutionError(f"{name}: {answer.get('error')}")
    call.__name__ = call.__qualname__ = name
    return call


def _harness(plain_data, spec):
    verdict = _private_stdout()
    requests = os.fdopen(spec["requests"], "w", encoding="utf-8")
    responses = os.fdopen(spec["responses"], "r", encoding="utf-8")
    line_bytes = spec["line_bytes"]
    try:
        hello = responses.readline(line_bytes + 1)
        hello = json.loads(hello) if hello.endswith("\n") else {"error": "no answer"}
        if "names" not in hello:
            raise SolutionError(str(hello.get("error")))
        solution = type(sys)("solution")
        sys.modules["solution"] = solution
        scope = {"__name__": "__main__", "__builtins__": __builtins__}
        for name in hello["names"]:
            # never a builtin's name: a solution's own `abs` or `sorted` would answer for the
            # test code's comparisons
            if isinstance(name, str) and name.isidentifier() and not hasattr(builtins, name):
                scope[name] = _proxy(plain_data, name, requests, responses, line_bytes)
                setattr(solution, name, scope[name])
        exec(_source("test_code.py"), scope)
        outcome = "pass"
    except SystemExit as e:
        outcome = "pass" if e.code in (None, 0) else f"fail: the test code exited with {e.code!r}"
    except BaseException as e:
        outcome = f"fail: {type(e).__name__}: {str(e)[:500]}"
    verdict.write(outcome + "\n")
    verdict.flush()
    return 0 if outcome == "pass" else 1


def _main_script():
    """solution.py as ``python solution.py`` would run it (the module ``__main__``)."""
    module = type(sys)("__main__")
    module.__file__ = "solution.py"
    sys.modules["__main__"] = module
    sys.argv = ["solution.py"]
    exec(_source("solution.py"), module.__dict__)


def main():
    spec = json.loads(sys.argv[1])
    _limit(spec["rlimits"])
    mode = spec["mode"]
    if mode == "main":
        _main_script()
        return 0
    sys.path.insert(0, os.getcwd())   # plain_data.py, beside this file in the sandbox
    plain_data = importlib.import_module("plain_data")
    sys.path.pop(0)
    if mode == "calls":
        _calls(plain_data)
    elif mode == "serve":
        _serve(plain_data)
    elif mode == "harness":
        return _harness(plain_data, spec)
    else:
        raise ValueError(f"unknown mode {mode!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The tests of a `reward.fn=code` row, as types (docs/rewards.md#code).

Row fields, as the public code-RL sets write them:

- ``tests: [{"input": str, "output": str}, ...]`` or ``tests: {"inputs": [...], "outputs":
  [...]}`` (APPS/TACO/LiveCodeBench "standard input"): one StdinTest each;
- ``fn_name`` with ``inputs`` (a list of argument lists) and ``outputs``, top level or inside
  ``tests`` as a dict (APPS's input_output): one CallTest each;
- ``test_code`` (a string): one test. When every statement is an assertion on calls with
  literal arguments (``assert f(1, [2]) == (3, 4)``, ``assert f(x)``, ``assert not f(x)``; also
  HumanEval's ``def check(candidate): ...`` followed by ``check(f)``; besides them only
  imports that bind no called name, literal assignments and docstrings) it is an AssertCalls,
  whose calls run in the solution's process and whose comparisons run in the scorer; any other
  script is an AssertScript, run by the harness (engine.rl.rewards.code_runner).

``tests`` may also be the JSON text of the list or the dict.
"""
from __future__ import annotations

import ast
import json
from dataclasses import dataclass
from typing import Any, Union

COMPARISONS = ("eq", "true", "false")   # == EXPECTED, truthy, falsy


@dataclass(frozen=True)
class StdinTest:
    """Passed when the program, given ``input`` on stdin, exits 0 and prints ``output``
    (whitespace-normalised: engine.rl.rewards.code.normalize_output)."""
    input: str
    output: str


@dataclass(frozen=True)
class CallTest:
    """Passed when ``fn_name(*args)`` returns ``expected`` compared as JSON values (a tuple
    equals a list), or the result wrapped in a one-element list equals it (as APPS writes
    it). ``fn_name`` is a function of the solution or a method of its ``class Solution``."""
    fn_name: str
    args: tuple
    expected: Any


@dataclass(frozen=True)
class Call:
    """One assertion of an AssertCalls: ``fn_name(*args, **kwargs)`` compared by
    ``comparison`` (COMPARISONS) with ``expected`` (Python's ``==`` on plain data)."""
    fn_name: str
    args: tuple
    kwargs: dict
    comparison: str = "eq"
    expected: Any = None


@dataclass(frozen=True)
class AssertCalls:
    """A test_code made only of assertions on calls (module docstring): passed when every
    call returns plain data that passes its comparison, run in order in one process."""
    calls: tuple[Call, ...]


@dataclass(frozen=True)
class AssertScript:
    """Any other test_code: passed when the harness runs it to its end (code_runner)."""
    code: str


CodeTest = Union[StdinTest, CallTest, AssertCalls, AssertScript]


def parse_tests(fields: dict[str, Any]) -> list[CodeTest]:
    """The row's tests (module docstring); ValueError naming what is wrong when the row has
    none or they are malformed."""
    tests = fields.get("tests")
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except ValueError as e:
            raise ValueError(f"`tests` is a string but not JSON: {e}") from None
    spec = tests if isinstance(tests, dict) else fields
    if spec.get("fn_name"):
        return _call_tests(spec)
    if isinstance(tests, dict) and "inputs" in tests:
        pairs = _pairs(tests.get("inputs"), tests.get("outputs"))
        return [StdinTest(str(given), str(expected)) for given, expected in pairs]
    if isinstance(tests, list) and tests:
        out = []
        for i, test in enumerate(tests):
            if not (isinstance(test, dict) and "input" in test and "output" in test):
                raise ValueError(f"tests[{i}] must be {{\"input\": str, \"output\": str}}")
            out.append(StdinTest(str(test["input"]), str(test["output"])))
        return out
    code = fields.get("test_code")
    if isinstance(code, str) and code.strip():
        calls = assert_calls(code)
        return [AssertCalls(calls) if calls else AssertScript(code)]
    raise ValueError("the row has no tests: give `tests` [{input, output}], `fn_name` with "
                     "`inputs` and `outputs`, or `test_code`")


def _pairs(inputs: Any, outputs: Any) -> list[tuple]:
    if not (isinstance(inputs, list) and isinstance(outputs, list)) or not inputs:
        raise ValueError("`inputs` and `outputs` must be non-empty lists")
    if len(inputs) != len(outputs):
        raise ValueError(f"{len(inputs)} inputs but {len(outputs)} outputs")
    return list(zip(inputs, outputs))


def _call_tests(spec: dict) -> list[CodeTest]:
    name = spec["fn_name"]
    if not (isinstance(name, str) and name.isidentifier()):
        raise ValueError(f"fn_name={name!r} is not a Python name")
    out = []
    for i, (args, expected) in enumerate(_pairs(spec.get("inputs"), spec.get("outputs"))):
        if not isinstance(args, list):
            raise ValueError(f"inputs[{i}] must be a list of arguments, got "
                             f"{type(args).__name__}")
        out.append(CallTest(name, tuple(args), expected))
    return out


class _NotSimple(Exception):
    """The script is not only assertions on calls with literals."""


def assert_calls(code: str) -> tuple[Call, ...] | None:
    """The calls of a test_code made only of assertions on calls with literal arguments and
    expected values (module docstring), in order; None for any other script (also one that
    does not parse)."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return None
    checks: dict[str, list[ast.stmt]] = {}   # def check(candidate): assertions
    calls: list[Call] = []
    bound: set[str] = set()                  # names the script's imports and assignments bind
    try:
        for node in tree.body:
            if isinstance(node, ast.Assert):
                calls.append(_assertion(node.test, None, None))
            elif isinstance(node, ast.FunctionDef) and _is_check(node):
                checks[node.name] = _body(node)
            elif (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
                  and isinstance(node.value.func, ast.Name)
                  and node.value.func.id in checks):
                target = _check_target(node.value)
                param = _param(tree, node.value.func.id)
                calls += [_assertion(s.test, param, target) for s in checks[node.value.func.id]]
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
            elif isinstance(node, ast.Assign):
                ast.literal_eval(node.value)
                bound |= {n.id for t in node.targets for n in ast.walk(t)
                          if isinstance(n, ast.Name)}
            elif not (isinstance(node, (ast.Expr, ast.Pass)) and (
                    isinstance(node, ast.Pass) or isinstance(node.value, ast.Constant))):
                raise _NotSimple
    except (_NotSimple, ValueError, TypeError, SyntaxError, RecursionError):
        return None
    if not calls or any(c.fn_name in bound or c.fn_name in checks for c in calls):
        return None
    return tuple(calls)


def _is_check(node: ast.FunctionDef) -> bool:
    a = node.args
    return (len(a.args) == 1 and not (a.posonlyargs or a.kwonlyargs or a.vararg or a.kwarg
                                      or a.defaults) and not node.decorator_list)


def _param(tree: ast.Module, name: str) -> str:
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    return fn.args.args[0].arg


def _body(node: ast.FunctionDef) -> list[ast.Assert]:
    out = []
    for stmt in node.body:
        if isinstance(stmt, ast.Assert):
            out.append(stmt)
        elif not (isinstance(stmt, ast.Pass) or (isinstance(stmt, ast.Expr)
                                                 and isinstance(stmt.value, ast.Constant))):
            raise _NotSimple
    return out


def _check_target(call: ast.Call) -> str:
    if call.keywords or len(call.args) != 1 or not isinstance(call.args[0], ast.Name):
        raise _NotSimple
    return call.args[0].id


def _assertion(test: ast.expr, param: str | None, target: str | None) -> Call:
    """The Call an assertion's test makes; inside a check function, calls of its parameter
    ``param`` are calls of ``target``."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        name, args, kwargs = _call(test.operand, param, target)
        return Call(name, args, kwargs, "false")
    if isinstance(test, ast.Compare):
        if len(test.ops) != 1 or not isinstance(test.ops[0], ast.Eq):
            raise _NotSimple
        left, right = test.left, test.comparators[0]
        if not isinstance(left, ast.Call):
            left, right = right, left
        name, args, kwargs = _call(left, param, target)
        return Call(name, args, kwargs, "eq", ast.literal_eval(right))
    name, args, kwargs = _call(test, param, target)
    return Call(name, args, kwargs, "true")


def _call(node: ast.expr, param: str | None, target: str | None) -> tuple[str, tuple, dict]:
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
        raise _NotSimple
    name = node.func.id
    if param is not None:
        if name != param:
            raise _NotSimple
        name = target
    elif name == "candidate":
        raise _NotSimple
    if any(isinstance(a, ast.Starred) for a in node.args) or any(
            k.arg is None for k in node.keywords):
        raise _NotSimple
    return (name, tuple(ast.literal_eval(a) for a in node.args),
            {k.arg: ast.literal_eval(k.value) for k in node.keywords})


def tests_problem(row: dict[str, Any]) -> str | None:
    """Why the row's tests cannot be read (parse_tests' message), or None when they can."""
    try:
        parse_tests(row)
    except (ValueError, TypeError, KeyError) as e:
        return str(e)
    return None

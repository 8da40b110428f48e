"""Plain data as tagged JSON: the only form in which a value crosses a code sandbox's boundary
(engine.rl.rewards.code; docs/rewards.md#what-is-trusted). Standard library only, and no import
of the engine: the file is also copied into every sandbox, where code_runner imports it.

Plain data is ``None``, ``bool``, ``int``, ``float``, ``str``, ``bytes`` and ``list``,
``tuple``, ``set``, ``frozenset``, ``dict`` of plain data, each of exactly that type (a
subclass, such as an int whose ``__eq__`` is always True, is refused: its comparison would be
its own code). JSON keeps ``None``, ``bool``, ``int``, ``str``, finite floats and lists as
themselves; everything else is an object with one tag key, so that tuples, sets, dicts with
keys that are not strings, ``inf`` and ``nan`` come back as what they were:

    {"$float": "inf" | "-inf" | "nan"}   {"$tuple": [...]}   {"$set": [...]}
    {"$frozenset": [...]}   {"$dict": [[key, value], ...]}   {"$bytes": "hex"}

``decode`` builds only these types (never a class named by the data: no pickle), so the side
that compares (the scorer, the harness) compares values whose ``==`` is Python's own.
"""
import json
import math

MAX_DEPTH = 100   # deeper nesting is refused on both sides (ValueError)
_SEQUENCES = {tuple: "$tuple", set: "$set", frozenset: "$frozenset"}
_FROM_TAG = {"$tuple": tuple, "$set": set, "$frozenset": frozenset}


class NotPlainData(TypeError):
    """A value that is not plain data (module docstring)."""


def encode(value, depth=0):
    """The JSON-ready form of ``value``; NotPlainData for anything that is not plain data."""
    if depth > MAX_DEPTH:
        raise NotPlainData(f"nested deeper than {MAX_DEPTH}")
    kind = type(value)
    if value is None or kind in (bool, int, str):
        return value
    if kind is float:
        return value if math.isfinite(value) else {"$float": repr(value)}
    if kind is list:
        return [encode(v, depth + 1) for v in value]
    if kind in _SEQUENCES:
        return {_SEQUENCES[kind]: [encode(v, depth + 1) for v in value]}
    if kind is dict:
        return {"$dict": [[encode(k, depth + 1), encode(v, depth + 1)]
                          for k, v in value.items()]}
    if kind is bytes:
        return {"$bytes": value.hex()}
    raise NotPlainData(f"a {kind.__module__}.{kind.__qualname__} is not plain data")


def decode(data, depth=0):
    """The value ``encode`` gave ``data``; ValueError for anything ``encode`` cannot give."""
    if depth > MAX_DEPTH:
        raise ValueError(f"nested deeper than {MAX_DEPTH}")
    kind = type(data)
    if data is None or kind in (bool, int, str, float):
        if kind is float and not math.isfinite(data):
            raise ValueError("a bare non-finite float")
        return data
    if kind is list:
        return [decode(v, depth + 1) for v in data]
    if kind is not dict or len(data) != 1:
        raise ValueError(f"not tagged plain data: {str(data)[:80]}")
    (tag, body), = data.items()
    if tag == "$float" and body in ("inf", "-inf", "nan"):
        return float(body)
    if tag == "$bytes" and type(body) is str:
        return bytes.fromhex(body)
    if type(body) is not list:
        raise ValueError(f"tag {tag[:20]!r} with a body that is not a list")
    if tag in _FROM_TAG:
        try:
            return _FROM_TAG[tag](decode(v, depth + 1) for v in body)
        except TypeError as e:   # an unhashable element of a set
            raise ValueError(str(e)) from None
    if tag == "$dict":
        out = {}
        for pair in body:
            if type(pair) is not list or len(pair) != 2:
                raise ValueError("a $dict entry that is not a [key, value] pair")
            try:
                out[decode(pair[0], depth + 1)] = decode(pair[1], depth + 1)
            except TypeError as e:   # an unhashable key
                raise ValueError(str(e)) from None
        return out
    raise ValueError(f"unknown tag {tag[:20]!r}")


def dumps(value) -> str:
    """``value`` as one line of tagged JSON (NotPlainData when it is not plain data)."""
    try:
        return json.dumps(encode(value), allow_nan=False, separators=(",", ":"))
    except (ValueError, RecursionError) as e:   # an int past the digit limit of int->str
        raise NotPlainData(str(e)) from None


def loads(text):
    """The value of one line of tagged JSON; ValueError when it is not what ``dumps`` gives."""
    try:
        return decode(json.loads(text, parse_constant=_refuse_constant))
    except RecursionError:
        raise ValueError("nested too deep") from None


def _refuse_constant(name):
    raise ValueError(f"bare {name} in tagged JSON")

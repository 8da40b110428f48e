"""Secrets never leave the process: the copies of the configuration that are written or sent
somewhere (the trackers' params, a checkpoint's config.yaml, trackers.json, run log lines and
config errors, W&B's record of the command line) are redacted; the configuration the program
runs with keeps every value.

The rule (docs/metrics.md, "Secrets"):
- a **secret key** is a config key (or header, flag, query parameter name) whose last dotted
  component, camelCase split into words (`accessToken` -> `access_token`, `HFToken` ->
  `hf_token`), lower-cased with `-` read as `_`, is one of SECRET_WORDS or ends in `_` + one
  of them: `env.agent_api_key`, `hf_token`, `env.kwargs.accessToken`, `clientSecret`,
  `X-Api-Key`, `Authorization` are secret; `max_tokens`, `maxNewTokens`, `tokenizer`,
  `api_key_env` (the *name* of a variable), `token_dispatcher` are not. A secret key's value
  becomes MASK ("***"); a null stays null (no secret is set);
- in every other string (values, list items, command-line arguments, messages), these
  credential spans become MASK (redact_text):
  - a URI's whole userinfo: `https://user:pass@host` and `https://TOKEN@host` ->
    `https://***@host`. The authority (what follows `//` up to `/`, `?` or `#`) holding a
    `:` (a `user:password`, or a port) the userinfo ends at the LAST `@` of the URI, so a
    password holding `@`, `/`, `?` or `#` goes whole (`https://u:p@ss/w0rd@host/x` ->
    `https://***@host/x`); else at the last `@` of the authority (`TOKEN@host`). An `@`
    later in such a URI's path or query is masked up to as well (`http://h:80/p@x` ->
    `http://***@x`: more than the secret, never less); `http://h/p@x` has no userinfo;
  - the value of each query parameter whose name is a secret key (`?token=abc&x=1` ->
    `?token=***&x=1`, `X-Amz-Signature=...`);
  - the value of a `name=value` or `name: value` pair whose name is a secret key, the name
    bare or quoted, the value quoted or bare up to whitespace or one of `,;'"{}[]()<>`
    (`Authorization: Bearer sk-1` -> `Authorization: Bearer ***`, a Hydra dict override
    `{api_key: sk-1, n: 2}` -> `{api_key: ***, n: 2}`); an HTTP auth scheme word before the
    value (`Bearer`, `Basic`, `Token`) stays;
  - the credential after `Bearer` anywhere (`Bearer sk-1` -> `Bearer ***`).

`redacted_container(cfg)` / `redacted_yaml(cfg)` are the configuration to write or log;
`redact_argv(argv)` a command line (`key=value`, `--key=value` and `--key value` with a secret
key are masked, the rest through redact_text: URIs, and secret keys inside a dict- or
list-valued override); `secret_values(cfg)` the literal secrets a configuration holds and
`scrub(text, secrets)` a message (a library's exception text) with each of them and any
credential spans masked.
"""
from __future__ import annotations

import re
from typing import Any, Iterable, Iterator

from omegaconf import OmegaConf

__all__ = ["MASK", "MIN_SECRET_CHARS", "SECRET_WORDS", "is_secret_key", "redact_text",
           "redact_tree", "redacted_container", "redacted_yaml", "redact_argv", "secret_values",
           "scrub"]

MASK = "***"
MIN_SECRET_CHARS = 4
SECRET_WORDS = ("api_key", "apikey", "token", "secret", "password", "passwd", "credential",
                "credentials", "private_key", "access_key", "secret_key", "auth",
                "authorization", "cookie", "signature", "sig")
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://")
_URI_END = re.compile(r"[\s'\"`<>]")
_QUERY = re.compile(r"([?&;])([^=&;#\s'\"]+)=([^&;#\s'\"]*)")
_BARE = r"(?:\\.|[^\s'\"`,;{}\[\]()<>\\])+"
_PAIR = re.compile(r"(?<![\w.\-/@:*?&;])(?P<q>[\"']?)(?P<name>[A-Za-z_][\w.\-]*)(?P=q)"
                   r"\s*(?:=(?!=)|:)[ \t]*(?:(?i:bearer|basic|token)[ \t]+)?"
                   rf"(?:\"(?P<dq>[^\"]*)\"|'(?P<sq>[^']*)'|(?P<bare>{_BARE}))")
_BEARER = re.compile(rf"(?i)\bbearer[ \t]+({_BARE})")


def is_secret_key(key: str) -> bool:
    """Whether config key (or query parameter / flag / header name) `key` names a secret
    (module docstring): its last dotted component, camelCase split, is a SECRET_WORDS word or
    ends in `_<word>`."""
    last = _CAMEL.sub("_", str(key).rsplit(".", 1)[-1]).lower().replace("-", "_")
    return any(last == word or last.endswith("_" + word) for word in SECRET_WORDS)


def _userinfo_spans(text: str) -> Iterator[tuple[int, int]]:
    """[start, end) of each URI userinfo in `text` (module docstring: the last `@` of the URI
    when its authority holds a `:`, else the last `@` of the authority)."""
    for scheme in _SCHEME.finditer(text):
        start = scheme.end()
        end = _URI_END.search(text, start)
        uri = text[start:end.start() if end else len(text)]
        authority = re.match(r"[^/?#]*", uri).group(0)
        if ":" in authority and "@" in uri:
            cut = uri.rindex("@")
        elif "@" in authority:
            cut = authority.rindex("@")
        else:
            continue
        if cut:
            yield start, start + cut


def _spans(text: str) -> list[tuple[int, int]]:
    """The credential spans of `text` (module docstring), [start, end), sorted and merged."""
    found = list(_userinfo_spans(text))
    found += [m.span(3) for m in _QUERY.finditer(text) if is_secret_key(m.group(2))]
    for m in _PAIR.finditer(text):
        if is_secret_key(m.group("name")):
            group = next(g for g in ("dq", "sq", "bare") if m.group(g) is not None)
            found.append(m.span(group))
    found += [m.span(1) for m in _BEARER.finditer(text)]
    merged: list[list[int]] = []
    for start, end in sorted(found):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def redact_text(text: str) -> str:
    """`text` with every credential span (module docstring) masked: URI userinfo, secret query
    values, values of secret `name=value` / `name: value` pairs, the credential after
    `Bearer`. Idempotent: a redacted text redacts to itself."""
    out, last = [], 0
    for start, end in _spans(text):
        out += [text[last:start], MASK]
        last = end
    return "".join(out) + text[last:]


def _redact(key: str, value: Any) -> Any:
    if is_secret_key(key) and value is not None and not isinstance(value, (dict, list)):
        return MASK
    if isinstance(value, dict):
        return redact_tree(value, key)
    if isinstance(value, list):
        return [_redact(key, item) for item in value]
    return redact_text(value) if isinstance(value, str) else value


def redact_tree(tree: dict, prefix: str = "") -> dict:
    """A redacted copy of a nested plain dict of config values (`prefix`: the dotted key of
    `tree` itself); a dict under a secret key has its string leaves masked too."""
    out = {}
    for key, value in tree.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and is_secret_key(dotted):
            out[key] = {k: (MASK if v is not None else None) for k, v in value.items()}
        else:
            out[key] = _redact(dotted, value)
    return out


def redacted_container(cfg: Any) -> dict:
    """The resolved configuration `cfg` (a structured config or dataclass) as a plain nested
    dict, redacted."""
    return redact_tree(OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True))


def redacted_yaml(cfg: Any) -> str:
    """The resolved configuration as YAML, redacted (a checkpoint's config.yaml)."""
    return OmegaConf.to_yaml(OmegaConf.create(redacted_container(cfg)))


def redact_argv(argv: Iterable[str]) -> list[str]:
    """A command line with secrets masked: `[+]key=value` and `--key=value` whose key is a
    secret key, the argument after a `--key` flag that is one, and redact_text's spans
    elsewhere (URI credentials, secret keys inside a dict- or list-valued override
    `env.kwargs={api_key: sk-1}`)."""
    out: list[str] = []
    for arg in argv:
        arg = str(arg)
        name, eq, _ = arg.partition("=")
        if out and out[-1].startswith("--") and "=" not in out[-1] and is_secret_key(
                out[-1].lstrip("-")):
            out.append(MASK)
        elif eq and is_secret_key(name.lstrip("+-~")):
            out.append(f"{name}={MASK}")
        else:
            out.append(redact_text(arg))
    return out


def secret_values(cfg: Any) -> list[str]:
    """The literal secrets of a configuration: the string values of secret keys and the
    credential spans redact_text masks in the other strings (a userinfo's password also
    alone), those of at least MIN_SECRET_CHARS characters (a shorter one would mask ordinary
    words of a message; the structural redaction of redact_text still masks it in place),
    longest first (a secret holding another goes whole)."""
    found: set[str] = set()

    def walk(key: str, value: Any, secret: bool) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{key}.{k}" if key else str(k), v, secret or is_secret_key(f"{key}.{k}"))
        elif isinstance(value, list):
            for item in value:
                walk(key, item, secret)
        elif isinstance(value, str) and value:
            if secret or is_secret_key(key):
                found.add(value)
            found.update(value[start:end] for start, end in _spans(value))
            for start, end in _userinfo_spans(value):   # user:password -> the password too
                found.add(value[start:end].partition(":")[2])

    walk("", OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True), False)
    return sorted((s for s in found if len(s) >= MIN_SECRET_CHARS), key=lambda s: (-len(s), s))


def scrub(text: str, secrets: Iterable[str] = ()) -> str:
    """`text` with every string of `secrets` and any credential spans (redact_text) masked."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, MASK)
    return redact_text(text)

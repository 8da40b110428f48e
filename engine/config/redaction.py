"""Secrets never leave the process: the copies of the configuration that are written or sent
somewhere (the trackers' params, a checkpoint's config.yaml, run log lines, W&B's record of the
command line) are redacted; the configuration the program runs with keeps every value.

The rule (docs/metrics.md, "Secrets"):
- a **secret key** is a config key whose last dotted component, lower-cased with `-` read as
  `_`, is one of SECRET_WORDS or ends in `_` + one of them: `env.agent_api_key`, `hf_token`,
  `env.kwargs.password`, `client_secret` are secret; `max_tokens`, `api_key_env` (the *name*
  of a variable), `token_dispatcher` are not. A secret key's value becomes MASK ("***"); a
  null stays null (no secret is set);
- in every other string (values, list items, command-line arguments, messages), the
  credentials of a URI become MASK: its whole userinfo (`https://user:pass@host` ->
  `https://***@host`, `https://TOKEN@host` -> `https://***@host`) and the value of each query
  parameter whose name is a secret key (`?token=abc&x=1` -> `?token=***&x=1`,
  `X-Amz-Signature=...`).

`redacted_container(cfg)` / `redacted_yaml(cfg)` are the configuration to write or log;
`redact_argv(argv)` a command line (`key=value`, `--key=value` and `--key value` with a secret
key are masked, URIs in the rest); `secret_values(cfg)` the literal secrets a configuration
holds and `scrub(text, secrets)` a message (a library's exception text) with each of them and
any URI credentials masked.
"""
from __future__ import annotations

import re
from typing import Any, Iterable

from omegaconf import OmegaConf

__all__ = ["MASK", "MIN_SECRET_CHARS", "SECRET_WORDS", "is_secret_key", "redact_text",
           "redact_tree", "redacted_container", "redacted_yaml", "redact_argv", "secret_values",
           "scrub"]

MASK = "***"
MIN_SECRET_CHARS = 4
SECRET_WORDS = ("api_key", "apikey", "token", "secret", "password", "passwd", "credential",
                "credentials", "private_key", "access_key", "secret_key", "auth",
                "signature", "sig")
_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*://)([^/\s@?#'\"]+)@")
_QUERY = re.compile(r"([?&;])([^=&;#\s'\"]+)=([^&;#\s'\"]*)")


def is_secret_key(key: str) -> bool:
    """Whether config key (or query parameter / flag name) `key` names a secret (module
    docstring): its last dotted component is a SECRET_WORDS word or ends in `_<word>`."""
    last = str(key).rsplit(".", 1)[-1].lower().replace("-", "_")
    return any(last == word or last.endswith("_" + word) for word in SECRET_WORDS)


def redact_text(text: str) -> str:
    """`text` with the credentials of every URI in it masked (userinfo, secret query values)."""
    text = _USERINFO.sub(lambda m: f"{m.group(1)}{MASK}@", text)
    return _QUERY.sub(lambda m: (f"{m.group(1)}{m.group(2)}={MASK}" if is_secret_key(m.group(2))
                                 else m.group(0)), text)


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
    secret key, the argument after a `--key` flag that is one, and URI credentials elsewhere."""
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
    """The literal secrets of a configuration: the string values of secret keys and the parts
    of URIs that redact_text masks (a userinfo's password also alone), those of at least
    MIN_SECRET_CHARS characters (a shorter one would mask ordinary words of a message; the
    structural redaction of redact_text still masks it in a URI), longest first (a secret
    holding another goes whole)."""
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
            for m in _USERINFO.finditer(value):   # user:password, and the password alone
                found.update((m.group(2), m.group(2).partition(":")[2]))
            found.update(m.group(3) for m in _QUERY.finditer(value)
                         if is_secret_key(m.group(2)) and m.group(3))

    walk("", OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True), False)
    return sorted((s for s in found if len(s) >= MIN_SECRET_CHARS), key=lambda s: (-len(s), s))


def scrub(text: str, secrets: Iterable[str] = ()) -> str:
    """`text` with every string of `secrets` and any URI credentials masked."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, MASK)
    return redact_text(text)

"""Loading a configuration: schema defaults, an optional YAML file (`--config`) and hydra
overrides composed into a structured dataclass, with errors that name the key, where it was
given and the valid keys of its group.

Free-form dict fields (a `Dict[str, X]` of the schema, e.g. `env.kwargs`) take new keys in
every hydra form: `env.kwargs={fail_step:2,name:x}` (merged into the dict, hydra's rule for a
dict value), `env.kwargs.fail_step=2` and `+env.kwargs.fail_step=2`; the values are still
checked against X. Every fixed key stays closed: a typo is an unknown key naming the valid keys
of its group, also when written with hydra's `+` / `++` (which would otherwise add it to the
dataclass unchecked)."""
from __future__ import annotations

import os
from typing import Any, Optional

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import (ConfigAttributeError, ConfigKeyError, OmegaConfBaseException,
                              ValidationError)

from engine.config.redaction import is_secret_key, redacted_yaml, scrub
from engine.errors import ConfigError

# Keys renamed in this release: refused with the new name.
RENAMED_KEYS = {"rollout.sglang_tp_size": "rollout.gpus_per_engine",
                "rollout.sglang.tp_size": "rollout.gpus_per_engine",
                "rollout.sglang_mem_fraction": "rollout.sglang.mem_fraction",
                "rollout.tis_cap": "rollout_correction.rollout_is_threshold (with "
                                   "rollout_correction.rollout_is=token)"}


def split_argv(argv: list[str]) -> tuple[Optional[str], list[str], list[str]]:
    """(config file, overrides, flags like --validate)."""
    config_file, overrides, flags = None, [], []
    it = iter(argv)
    for arg in it:
        if arg == "--config":
            config_file = next(it, None)
        elif arg.startswith("--config="):
            config_file = arg.split("=", 1)[1]
        elif arg.startswith("config="):
            config_file = arg.split("=", 1)[1]
        elif arg.startswith("--"):
            flags.append(arg)
        else:
            overrides.append(arg)
    return config_file, overrides, flags


def config_yaml(cfg) -> str:
    """The resolved configuration as YAML (saved with every checkpoint, for humans), secrets
    redacted (engine.config.redaction: secret keys and URI credentials read `***`)."""
    return redacted_yaml(cfg)


def load_config(schema: type, argv: list[str]) -> tuple[Any, list[str]]:
    """Compose schema defaults, an optional YAML file and hydra overrides into a `schema`
    instance. Returns (config, flags)."""
    config_file, overrides, flags = split_argv(argv)
    try:
        base = OmegaConf.structured(schema)
        if config_file:
            if not os.path.isfile(config_file):
                raise ConfigError(f"--config {config_file}: file not found")
            base = OmegaConf.merge(base, OmegaConf.load(config_file))
        _open_free_form_dicts(base)
        name = f"_run_{schema.__name__}"
        ConfigStore.instance().store(name=name, node=base)
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=os.path.abspath(os.path.dirname(__file__)),
                                   version_base=None):
            cfg = compose(config_name=name, overrides=overrides)
        added = _added_fixed_key(cfg)
        if added:
            key, valid = added
            group = key.rpartition(".")[0]
            raise ConfigError(f"unknown key {key} on the command line; valid keys of "
                              f"{group or 'the top level'}: {', '.join(valid)}")
        return OmegaConf.to_object(cfg), flags
    except ConfigError:
        raise
    except (OmegaConfBaseException, Exception) as e:  # hydra wraps errors in several types
        message = _describe_load_error(e, schema, config_file)
        raise ConfigError(scrub(message, _override_secrets(overrides))) from None


def _override_secrets(overrides: list[str]) -> list[str]:
    """The literal values given to secret keys on the command line (`key=value`, a list or
    dict value also item by item), longest first: hydra's and OmegaConf's own errors quote
    an override's text, so the message is scrubbed of them (engine.config.redaction)."""
    found: set[str] = set()
    for override in overrides:
        key, eq, value = override.partition("=")
        if not eq or not is_secret_key(key.lstrip("+~")):
            continue
        found.add(value)
        found.update(part.strip(" '\"") for part in value.strip("[]{} ").split(","))
    return sorted((s for s in found if s), key=lambda s: (-len(s), s))


def _is_free_form(node: DictConfig) -> bool:
    """A dict whose keys are data, not schema fields (a Dict[str, X] field of a dataclass)."""
    return node._metadata.object_type in (None, dict)


def _open_free_form_dicts(node: DictConfig) -> None:
    """Take every free-form dict under `node` out of struct mode (hydra composes in struct mode,
    where only `+key.a=1` may add a key): `key={a:1}` and `key.a=1` then add keys too. Fixed
    groups keep inheriting struct mode."""
    for key in node.keys():
        child = node._get_node(key)
        if not isinstance(child, DictConfig) or child._is_none() or child._is_missing():
            continue
        if _is_free_form(child):
            OmegaConf.set_struct(child, False)
        else:
            _open_free_form_dicts(child)


def _added_fixed_key(node: DictConfig, prefix: str = "") -> Optional[tuple[str, list[str]]]:
    """(full key, valid keys of its group) of the first key of a dataclass group of the
    composed `node` that is not one of its fields (added with hydra's + or ++), or None."""
    object_type = node._metadata.object_type
    fields = (list(getattr(object_type, "__dataclass_fields__", {}))
              if not _is_free_form(node) else None)
    for key in node.keys():
        full = f"{prefix}{key}"
        if fields is not None and key not in fields:
            return full, fields
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_none() and not child._is_missing():
            found = _added_fixed_key(child, full + ".")
            if found:
                return found
    return None


def _error_chain(error: BaseException) -> list[BaseException]:
    """`error` and the exceptions it was raised from, outermost first."""
    chain: list[BaseException] = []
    while error is not None and error not in chain:
        chain.append(error)
        error = error.__cause__ or error.__context__
    return chain


def _group_keys(schema: type, group: str) -> list[str]:
    """The keys of config group `group` of `schema` ("" for the top level; [] if no group)."""
    node = OmegaConf.structured(schema)
    if group:
        node = OmegaConf.select(node, group, default=None)
    return [str(k) for k in node.keys()] if OmegaConf.is_dict(node) else []


def _describe_load_error(error: BaseException, schema: type, config_file: Optional[str]) -> str:
    """The message for a failure of load_config. An unknown key: the key, where it was given
    and the valid keys of its group. A value of the wrong type: the key and what was wrong.
    Anything else (YAML syntax, override syntax): the messages of the exception chain."""
    chain = _error_chain(error)
    origin = ("on the command line" if isinstance(chain[0], HydraException)
              else f"in --config {config_file}")
    for err in chain:
        key = getattr(err, "full_key", None)
        if not key:
            continue
        first_line = str(err).splitlines()[0].strip()
        if isinstance(err, (ConfigKeyError, ConfigAttributeError)):
            if key in RENAMED_KEYS:
                return (f"{key} ({origin}) was renamed to {RENAMED_KEYS[key]}; use the new "
                        "key (README, configuration)")
            group = key.rpartition(".")[0]
            valid = ", ".join(_group_keys(schema, group))
            return (f"unknown key {key} {origin}; valid keys of "
                    f"{group or 'the top level'}: {valid}")
        if isinstance(err, ValidationError):
            hint = (f"; write a list: {key}=[a,b]" if "ListConfig" in first_line else "")
            return f"{key} ({origin}): {first_line}{hint}"
    parts: list[str] = []
    for err in chain:
        text = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
        if text and text not in parts:
            parts.append(text)
    return f"invalid configuration {origin}: " + "; ".join(parts)

"""The one run-config check every system uses: typed parsing and range checks.

Each system's configuration (joint DP's :class:`~flwr_jdp.joint_dp.config.JobConfig`,
DP-MTL's, subject-level DP's, Priv-AltMin's) is a frozen dataclass whose field
``x_y`` is the Flower run-config key ``x-y``. :func:`parse_dataclass` reads one from
a run config (values coerced to each field's type, unknown keys ignored, an optional
namespace prefix such as ``jdp.``), and :func:`need` is the one range check, so a
bad value fails at start-up naming the key and its allowed range in the same words
everywhere::

    run-config key 'delta' must be in (0, 1), got 1.0

This module imports nothing of the project, so any module may use it.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import re
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import MISSING, fields
from typing import Any, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A run-config value outside its allowed range (a ``ValueError``)."""


def config_key(name: str) -> str:
    """The run-config key of dataclass field ``name`` (``target_epsilon`` -> ``target-epsilon``)."""
    return name.replace("_", "-")


def need(ok: bool, key: str, allowed: str, value: Any) -> None:
    """Unless ``ok``: :class:`ConfigError`
    ``run-config key '<key>' must be <allowed>, got <value!r>``."""
    if not ok:
        raise ConfigError(_message(key, allowed, value))


def _message(key: str, allowed: str, value: Any) -> str:
    return f"run-config key '{key}' must be {allowed}, got {value!r}"


def _integer(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
    number = float(value)
    if not number.is_integer():
        raise ValueError
    return int(number)


def coerce(key: str, value: Any, default: Any) -> Any:
    """``value`` as the type of ``default`` (bool, int, float or str), or a
    :class:`ConfigError` naming ``key``. Booleans accept ``true``/``false`` strings;
    ints accept integral floats and numeric strings, not booleans; floats refuse
    booleans."""
    try:
        if isinstance(default, bool):
            if isinstance(value, str):
                if value.lower() not in ("true", "false"):
                    raise ValueError
                return value.lower() == "true"
            return bool(value)
        if isinstance(default, int):
            return _integer(value)
        if isinstance(default, float):
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if isinstance(default, str):
            return str(value)
        return value
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(_message(key, f"of type {type(default).__name__}", value)) from None


def _keymap(cls: type, keys: Mapping[str, str] | None) -> dict[str, str]:
    return dict(keys) if keys is not None else {config_key(f.name): f.name for f in fields(cls)}


def read_fields(cls: type, run_config: Mapping[str, Any], keys: Mapping[str, str] | None = None,
                prefix: str = "") -> dict[str, Any]:
    """The values of dataclass ``cls``'s fields that ``run_config`` sets, each coerced
    to the type of the field's default. ``keys``: run-config key -> field name
    (default: every field, key :func:`config_key`); each is looked up as
    ``prefix + key``. Keys not in ``keys`` are ignored (other apps share the run config)."""
    defaults = {f.name: f.default for f in fields(cls)}
    out: dict[str, Any] = {}
    for key, name in _keymap(cls, keys).items():
        if prefix + key in run_config:
            raw = run_config[prefix + key]
            default = defaults[name]
            out[name] = raw if default is MISSING else coerce(prefix + key, raw, default)
    return out


def parse_dataclass(cls: type[T], run_config: Mapping[str, Any], keys: Mapping[str, str] | None = None,
                    prefix: str = "") -> T:
    """Dataclass ``cls`` from ``run_config`` (:func:`read_fields`; absent keys keep
    their defaults); its own checks (:func:`need` in ``__post_init__``) run on
    construction. Every error is a :class:`ConfigError` naming ``prefix + key``: a
    plain ``ValueError`` from ``cls`` whose message starts with a key is reworded to
    name that key."""
    keymap = _keymap(cls, keys)
    values = read_fields(cls, run_config, keymap, prefix)
    with key_prefix(prefix):
        try:
            return cls(**values)
        except ConfigError:
            raise
        except ValueError as err:
            msg = str(err)
            key = next((k for k in sorted(keymap, key=len, reverse=True) if msg.startswith(k)), None)
            raise ConfigError(f"run-config key '{key}': {msg}" if key else msg) from None


@contextmanager
def key_prefix(prefix: str) -> Iterator[None]:
    """Inside: a :class:`ConfigError` naming ``run-config key 'x'`` is re-raised
    naming ``run-config key '<prefix>x'`` (a namespaced app's keys)."""
    try:
        yield
    except ConfigError as err:
        if not prefix:
            raise
        pattern = "run-config key '(?!" + re.escape(prefix) + ")"
        raise ConfigError(re.sub(pattern, f"run-config key '{prefix}", str(err))) from None


def namespace(run_config: Mapping[str, Any], prefix: str, known: Iterable[str],
              what: str = "flwr-jdp's keys") -> dict[str, Any]:
    """The ``prefix``-ed keys of ``run_config`` (``jdp.target-epsilon``), without the
    prefix; other keys (the app's own) are ignored. A ``prefix``-ed key not in
    ``known`` fails naming it and listing the known ones (``what`` are ...)."""
    allowed = sorted(known)
    values: dict[str, Any] = {}
    for key, value in run_config.items():
        if key.startswith(prefix):
            name = key[len(prefix):]
            if name not in allowed:
                raise ConfigError(f"unknown run-config key '{key}'{did_you_mean(name, allowed, prefix)}; "
                                  f"{what} are {', '.join(prefix + k for k in allowed)}")
            values[name] = _referred(run_config, key, name, value, prefix)
    return values


#: Keys a ``jdp`` table may set by naming one of the app's own keys
#: (``num-rounds = "num-server-rounds"``), so that the app sets each once.
REFERABLE = ("num-rounds", "rounds", "local-epochs", "batch-size")


def _referred(run_config: Mapping[str, Any], key: str, name: str, value: Any, prefix: str) -> Any:
    """``value``, or the value of the app's own key it names (a :data:`REFERABLE` key)."""
    if name not in REFERABLE or not isinstance(value, str):
        return value
    if value.startswith(prefix) or value not in run_config:
        raise ConfigError(f"run-config key '{key}' = {value!r} names no key of your app's run config; give a "
                          f"number, or the name of your own key that holds it (e.g. \"num-server-rounds\")")
    return run_config[value]


def did_you_mean(name: str, known: Iterable[str], prefix: str = "") -> str:
    """`` (did you mean 'x'?)`` for the known key closest to a misspelt ``name``
    (difflib's closest, else a key that ends with it), or ``""``."""
    known = list(known)
    close = difflib.get_close_matches(name, known, n=1) or [
        k for k in known if k.endswith((f"-{name}", f"_{name}"))]
    return f" (did you mean '{prefix}{close[0]}'?)" if close else ""


#: flwr-jdp keys no app is likely to use for itself: one of them outside the ``jdp``
#: table (and not in it, or in it with another value) is a setting put in the wrong
#: place, which would silently leave another value (the default ``target-epsilon =
#: 8``) in force, so it is refused.
PRIVACY_KEYS = ("personal-layers", "target-epsilon", "delta", "noise-multiplier", "clipping-norm",
                "privacy-unit", "noise-placement", "accountant", "neighbouring", "records-per-user",
                "user-batch-size", "secure-noise", "noise-seed", "max-skipped-rounds", "min-valid-fraction",
                "dropout-tolerance", "colluding-owners")


def refuse_misplaced(run_config: Mapping[str, Any], prefix: str, keys: Iterable[str]) -> None:
    """A :class:`ConfigError` if one of ``keys`` (privacy settings no app is likely
    to use for itself) is in ``run_config`` outside the ``prefix`` table: absent from
    the table, or in it with another value. Either would silently leave another value
    (a default budget) in force."""
    keys = set(keys)
    for k in sorted(k for k in run_config if k in keys):
        inside = f"{prefix}{k}"
        if inside in run_config and run_config[inside] != run_config[k]:
            raise ConfigError(f"run-config keys '{k}'={run_config[k]!r} and '{inside}'={run_config[inside]!r} "
                              f"differ: flwr-jdp reads only '{inside}'; remove '{k}' or give it the same value")
    misplaced = sorted(k for k in run_config if k in keys and f"{prefix}{k}" not in run_config)
    if misplaced:
        table = prefix.rstrip(".")
        raise ConfigError(
            f"run-config key '{misplaced[0]}' is set outside the [tool.flwr.app.config.{table}] table, "
            f"where flwr-jdp does not read it (it reads '{prefix}{misplaced[0]}'): move it into that table"
            + (f" (also {', '.join(repr(k) for k in misplaced[1:])})" if misplaced[1:] else ""))


#: Run-config keys that do not change what a run computes (left out of
#: :func:`config_digest`): ``resume`` only says whether to continue a checkpoint.
IGNORED_KEYS = ("resume",)


def config_digest(config: dict[str, Any]) -> str:
    """Digest of the configuration a checkpoint belongs to."""
    relevant = {k: v for k, v in sorted(config.items()) if k not in IGNORED_KEYS}
    return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()[:16]


def run_folder(results_dir: str, session: str) -> str:
    """Where a run writes: ``results-dir``, or (empty) a new folder of its own,
    ``results/<UTC date-time>-<session>``."""
    if results_dir:
        return results_dir
    import time

    return f"results/{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{session[:6]}"


__all__ = ["IGNORED_KEYS", "ConfigError", "config_digest", "coerce", "config_key", "key_prefix", "namespace", "need", "parse_dataclass",
           "read_fields", "run_folder"]

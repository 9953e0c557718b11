"""Config dicts and keyword overrides as the simulator's own TOML parser reads them.

A dict becomes TOML text (nested dicts become tables, e.g. ``profiles``), so it
goes through exactly the parser and checks a TOML file does: an unknown or
misspelt key is the same ``ConfigError``.
"""

import json
import math


def _value(v, key):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if hasattr(v, "__fspath__"):
        return json.dumps(str(v.__fspath__()), ensure_ascii=False)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x, key) for x in v) + "]"
    # numpy scalars and the like
    if hasattr(v, "item"):
        return _value(v.item(), key)
    raise TypeError(f"config key '{key}': cannot write a {type(v).__name__} value")


def to_toml(config):
    """The TOML text of a config dict (tables for nested dicts)."""
    lines, tables = [], []
    for key, v in config.items():
        if isinstance(v, dict):
            tables.append((key, v))
        else:
            lines.append(f"{key} = {_value(v, key)}")
    for name, table in tables:
        lines.append(f"[{name}]")
        for key, v in table.items():
            lines.append(f"{key} = {_value(v, name + '.' + key)}")
    return "\n".join(lines) + "\n"


def to_overrides(overrides):
    """``--set key=value`` texts for keyword overrides (``profiles={...}`` is flattened)."""
    out = []
    for key, v in overrides.items():
        if isinstance(v, dict):
            out += [f"{key}.{k}={_text(x)}" for k, x in v.items()]
        else:
            out.append(f"{key}={_text(v)}")
    return out


def _text(v):
    # --set takes a string key's text verbatim and types the others by the key.
    if isinstance(v, bool):
        return "true" if v else "false"
    if hasattr(v, "__fspath__"):
        return str(v.__fspath__())
    if isinstance(v, float):
        return repr(v)
    return str(v)

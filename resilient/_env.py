"""Settings read from the environment, refused by name when malformed.

Why one place: each knob was parsed where it was used, one leniently (a preemption grace of
"2m" fell back to the default without a word), others with Python's own error, which names
neither the variable nor what it takes.
"""

from __future__ import annotations

import os

__all__ = ["env_float", "env_seconds", "env_flag"]

_FLAGS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def env_float(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not a number") from None


def env_seconds(name: str, default: float | None) -> float | None:
    """A positive number of seconds; ``default`` (None: the setting is off) when unset."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    value = env_float(name, 0.0)
    if not value > 0:
        raise ValueError(f"environment variable {name}={raw!r} must be a positive number of seconds")
    return value


def env_flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return _FLAGS[raw.lower()]
    except KeyError:
        raise ValueError(f"environment variable {name}={raw!r} is not a flag (1/0, true/false, "
                         f"yes/no, on/off)") from None

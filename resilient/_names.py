"""The names a checkpoint's directory and files take, and their inverses.

Their own module because both the manifest's reader (``_format``) and its runs of boxes
(``_box_runs``, which name each box's file by its rank) need them.
"""

from __future__ import annotations

import re

__all__ = ["step_dir_name", "parse_step_dir", "data_file_name", "parse_data_file"]

# at least ten digits: a step past 9,999,999,999 (a count of tokens or samples used as the
# step) has more, and was written but never listed: invisible to restore, retention and the CLI
_STEP_RE = re.compile(r"^step-(\d{10}|[1-9]\d{10,})$")


def step_dir_name(step: int) -> str:
    return f"step-{step:010d}"


def parse_step_dir(name: str) -> int | None:
    match = _STEP_RE.match(name)
    return int(match.group(1)) if match else None


def data_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.data"


def parse_data_file(name: str) -> int | None:
    """The rank whose data file ``name`` is (``data_file_name``'s inverse), else None."""
    head, sep, tail = name.partition("rank-")
    digits = tail.removesuffix(".data")
    return int(digits) if not head and sep and tail.endswith(".data") and digits.isdigit() else None

"""Terminal output for resilient-ckpt: human units, relative times, tables, colour and
progress only on a terminal."""

from __future__ import annotations

import sys
import time
from typing import Sequence, TextIO

from .._units import human_bytes

_COLOURS = {"committed": "32", "partial": "33", "corrupt": "31", "added": "32", "removed": "31", "changed": "33"}


def human_age(created: float | None, now: float | None = None) -> str:
    if created is None:
        return "-"
    s = max(0.0, (now or time.time()) - created)
    for size, unit in ((86400, "d"), (3600, "h"), (60, "min")):
        if s >= size:
            return f"{s / size:.0f} {unit} ago"
    return f"{s:.0f} s ago"


def colour(text: str, key: str, stream: TextIO) -> str:
    code = _COLOURS.get(key)
    return f"\033[{code}m{text}\033[0m" if code and stream.isatty() else text


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], stream: TextIO | None = None,
          colour_col: int | None = None) -> None:
    stream = stream or sys.stdout
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip(), file=stream)
    for row in rows:
        cells = []
        for i, (cell, w) in enumerate(zip(row, widths)):
            padded = cell.ljust(w)
            cells.append(colour(padded, cell, stream) if i == colour_col else padded)
        print("  ".join(cells).rstrip(), file=stream)


class Progress:
    """A one-line byte counter on stderr, redrawn at most ten times a second on a terminal."""

    def __init__(self, what: str, total: int, stream: TextIO | None = None) -> None:
        self.what, self.total, self.stream = what, total, stream or sys.stderr
        self.done = 0
        self.start = time.monotonic()
        self._last = 0.0
        self.live = self.stream.isatty()

    def __call__(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.live and now - self._last > 0.1:
            self._last = now
            pct = 100 * self.done / self.total if self.total else 100
            self.stream.write(f"\r{self.what}: {human_bytes(self.done)} / {human_bytes(self.total)} ({pct:.0f}%)")
            self.stream.flush()

    def finish(self, summary: str) -> None:
        took = time.monotonic() - self.start
        rate = f", {human_bytes(self.done / took)}/s" if took > 0 and self.done else ""
        if self.live:
            self.stream.write("\r\033[K")
        self.stream.write(f"{summary} ({human_bytes(self.done)} in {took:.1f} s{rate})\n")
        self.stream.flush()

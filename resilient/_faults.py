"""Deliberate faults, so that anyone can watch a recovery: ``RESILIENT_FAULT``.

    RESILIENT_FAULT="kill:rank=1,step=50"             # SIGKILL rank 1 when it finishes step 50
    RESILIENT_FAULT="hang:rank=0,step=30"             # rank 0 stops making progress (sleeps)
    RESILIENT_FAULT="raise:rank=1,step=20"            # rank 1 raises RuntimeError
    RESILIENT_FAULT="kill:random=20-80,seed=7"        # a rank and a step in [20, 80], drawn from the seed
    RESILIENT_FAULT="kill:rank=1,step=50;hang:rank=0,step=120"   # several, in order
    RESILIENT_FAULT="kill:rank=1,step=50,phase=write"  # rank 1 dies while step 50's save is
                                                       # written: its file is on disk, its
                                                       # report never reaches the committer
    RESILIENT_FAULT="corrupt:rank=1,step=20,phase=write"   # one bit of rank 1's file of step 20
                                                       # flips once written (a disk's silent
                                                       # error): the step commits, and its
                                                       # checksums catch it at upload or restore

A step is "finished" when ``Checkpointer.save(step)`` is called for it (``phase=step``, the
default); ``phase=write`` fires in the background writer instead, once this rank's file of
that step is written and before the commit hears of it: the moment a peer's death leaves the
others waiting in a commit (``raise`` there fails the save, ``hang`` stalls its commit).

Each fault fires once per run: before firing, the process creates a marker file
(``RESILIENT_FAULT_DIR``, default ``<checkpoint root>/.faults``), so a restarted process
that trains through the same step again does not fire it again. A random fault draws the
same rank and step on every rank (same seed), and only that rank fires.
"""

from __future__ import annotations

import os
import random
import signal
import time
from dataclasses import dataclass
from typing import Callable

KINDS = ("kill", "hang", "raise", "corrupt")
PHASES = ("step", "write")


class InjectedFault(RuntimeError):
    """Raised by a ``raise`` fault."""


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int | None      # None: drawn at random
    step: int | None
    window: tuple[int, int] | None = None
    seed: int = 0
    phase: str = "step"

    def resolve(self, world_size: int) -> tuple[int, int]:
        """(rank, step) this fault fires at, the same on every rank."""
        if self.window is None:
            assert self.rank is not None and self.step is not None
            return self.rank, self.step
        draw = random.Random(self.seed)
        return draw.randrange(world_size), draw.randint(*self.window)


def parse(spec: str) -> list[Fault]:
    """Parse ``RESILIENT_FAULT``; a ValueError names the part at fault."""
    faults = []
    for part in (p.strip() for p in spec.split(";")):
        if not part:
            continue
        kind, sep, rest = part.partition(":")
        if kind not in KINDS or not sep:
            raise ValueError(f"RESILIENT_FAULT: {part!r} must start with one of {', '.join(KINDS)} and a colon")
        fields: dict[str, str] = {}
        for item in rest.split(","):
            key, eq, value = item.partition("=")
            if not eq:
                raise ValueError(f"RESILIENT_FAULT: {item!r} in {part!r} is not KEY=VALUE")
            fields[key.strip()] = value.strip()
        unknown = set(fields) - {"rank", "step", "random", "seed", "phase"}
        if unknown:
            raise ValueError(f"RESILIENT_FAULT: unknown key(s) {', '.join(sorted(unknown))} in {part!r}; "
                             "use rank=, step=, or random=LO-HI with seed=, and phase=")
        phase = fields.pop("phase", "step")
        if phase not in PHASES:
            raise ValueError(f"RESILIENT_FAULT: phase={phase!r} in {part!r} must be one of {', '.join(PHASES)}")
        if kind == "corrupt" and phase != "write":
            raise ValueError(f"RESILIENT_FAULT: {part!r}: corrupt damages the file a save writes; add phase=write")
        try:
            if "random" in fields:
                lo, _, hi = fields["random"].partition("-")
                window = (int(lo), int(hi))
                if window[0] > window[1] or window[0] < 0:
                    raise ValueError
                faults.append(Fault(kind, None, None, window, int(fields.get("seed", "0")), phase))
            else:
                faults.append(Fault(kind, int(fields["rank"]), int(fields["step"]), phase=phase))
        except (KeyError, ValueError):
            raise ValueError(f"RESILIENT_FAULT: {part!r} needs rank=R and step=S (non-negative integers), "
                             "or random=LO-HI (LO <= HI) with an optional seed=N") from None
    return faults


class FaultInjector:
    """Fires this rank's faults when their step is reached (see the module docstring)."""

    def __init__(self, spec: str, rank: int, world_size: int, marker_dir: str,
                 on_fire: Callable[[str, int], None] | None = None) -> None:
        self.rank = rank
        self.marker_dir = marker_dir
        self.on_fire = on_fire  # told (kind, step) first: an event log line survives a SIGKILL
        self._armed = []
        for index, fault in enumerate(parse(spec)):
            at_rank, at_step = fault.resolve(world_size)
            if at_rank == rank:
                self._armed.append((index, fault.kind, at_step, fault.phase))

    def check(self, step: int, phase: str = "step", path: str | None = None) -> None:
        """Fire the faults armed for ``step`` in ``phase`` (``step``: the training thread's
        ``save``; ``write``: the background writer, this rank's file ``path`` written, None
        for a rank that writes no file)."""
        for index, kind, at_step, at_phase in self._armed:
            if (step, phase) == (at_step, at_phase) and self._claim(f"fault-{index}-{kind}-rank{self.rank}-step{step}"):
                self._fire(kind, step, path)

    def check_write(self, step: int, path: str | None) -> None:
        self.check(step, "write", path)

    def _claim(self, name: str) -> bool:
        os.makedirs(self.marker_dir, exist_ok=True)
        try:
            os.close(os.open(os.path.join(self.marker_dir, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except FileExistsError:
            return False  # fired already in this run
        return True

    def _fire(self, kind: str, step: int, path: str | None = None) -> None:
        print(f"resilient: injected fault: {kind} on rank {self.rank} at step {step}", flush=True)
        if self.on_fire is not None:
            self.on_fire(kind, step)
        if kind == "corrupt":
            if path is not None:
                _flip_a_bit(path)
            return
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "hang":
            while True:
                time.sleep(3600)
        raise InjectedFault(f"injected fault on rank {self.rank} at step {step} (RESILIENT_FAULT)")


def _flip_a_bit(path: str) -> None:
    """Invert one bit in the middle of the file's first 64 kB: inside a chunk's data, where
    only its checksum can tell."""
    with open(path, "r+b") as f:
        offset = min(os.fstat(f.fileno()).st_size, 1 << 16) // 2
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))
        f.flush()
        os.fsync(f.fileno())


def from_env(rank: int, world_size: int, root: str,
             on_fire: Callable[[str, int], None] | None = None) -> FaultInjector | None:
    spec = os.environ.get("RESILIENT_FAULT", "").strip()
    if not spec:
        return None
    marker_dir = os.environ.get("RESILIENT_FAULT_DIR") or os.path.join(root, ".faults")
    return FaultInjector(spec, rank, world_size, marker_dir, on_fire)

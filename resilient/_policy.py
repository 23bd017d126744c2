"""When to save and what to keep, as small composable policies.

A save policy answers ``due(step, now)``; a retention policy answers ``keep(steps)``.
``AnyOf`` combines either kind. The Checkpointer builds them from ``every``,
``every_seconds`` and ``keep``; users may pass their own objects instead.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Collection, Protocol, Sequence, runtime_checkable

__all__ = [
    "SavePolicy",
    "RetentionPolicy",
    "EveryNSteps",
    "EveryNSeconds",
    "Always",
    "KeepLast",
    "KeepEvery",
    "AnyOf",
]


@runtime_checkable
class SavePolicy(Protocol):
    def due(self, step: int, now: float) -> bool: ...


@runtime_checkable
class RetentionPolicy(Protocol):
    def keep(self, steps: Sequence[int]) -> set[int]: ...


@dataclass(frozen=True)
class Always:
    def due(self, step: int, now: float) -> bool:
        return True


@dataclass(frozen=True)
class EveryNSteps:
    n: int

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"every must be a positive integer number of steps, got {self.n!r}")

    def due(self, step: int, now: float) -> bool:
        return step % self.n == 0


@dataclass
class EveryNSeconds:
    """Due when ``seconds`` have passed since the last time it was due (or since creation).

    Clock-based, so under torch.distributed rank 0's answer is broadcast (``time_based``).
    """

    seconds: float
    _last: float = field(default_factory=time.monotonic, repr=False)
    time_based = True

    def __post_init__(self) -> None:
        if not self.seconds > 0:
            raise ValueError(f"every_seconds must be > 0, got {self.seconds!r}")

    def due(self, step: int, now: float) -> bool:
        if now - self._last >= self.seconds:
            self._last = now
            return True
        return False


@dataclass(frozen=True)
class KeepLast:
    n: int

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise ValueError(f"keep must be a positive integer, a retention policy or None, got {self.n!r}")

    def keep(self, steps: Sequence[int]) -> set[int]:
        return set(sorted(steps)[-self.n :])


@dataclass(frozen=True)
class KeepEvery:
    """Milestones: keep every step divisible by ``k`` forever."""

    k: int

    def __post_init__(self) -> None:
        if not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"KeepEvery needs a positive integer, got {self.k!r}")

    def keep(self, steps: Sequence[int]) -> set[int]:
        return {s for s in steps if s % self.k == 0}


class AnyOf:
    """Due when any policy is due; keeps what any policy keeps."""

    def __init__(self, *policies: object) -> None:
        self.policies = policies
        self.time_based = any(getattr(p, "time_based", False) for p in policies)

    def due(self, step: int, now: float) -> bool:
        # evaluate all, so that clock-based policies reset together
        return any([p.due(step, now) for p in self.policies])  # type: ignore[attr-defined]

    def keep(self, steps: Sequence[int]) -> set[int]:
        kept: set[int] = set()
        for p in self.policies:
            kept |= p.keep(steps)  # type: ignore[attr-defined]
        return kept

    def __repr__(self) -> str:
        return f"AnyOf{self.policies!r}"


def save_policy(every: int | None, every_seconds: float | None) -> SavePolicy:
    parts = [EveryNSteps(every)] if every is not None else []
    if every_seconds is not None:
        if not isinstance(every_seconds, (int, float)) or isinstance(every_seconds, bool):
            raise ValueError(f"every_seconds must be a number of seconds, got {every_seconds!r}")  # "60" was taken
        parts.append(EveryNSeconds(float(every_seconds)))
    if not parts:
        return Always()
    return parts[0] if len(parts) == 1 else AnyOf(*parts)  # type: ignore[return-value]


def retention_policy(keep: int | RetentionPolicy | None, name: str = "keep") -> RetentionPolicy | None:
    """``keep`` as a policy; ``name`` is the argument's, for the error (``keep_remote=0``
    was refused as ``keep``)."""
    if keep is None or isinstance(keep, RetentionPolicy):
        return keep
    try:
        return KeepLast(keep)
    except ValueError as exc:
        raise ValueError(str(exc).replace("keep", name, 1)) from None


def to_delete(policy: RetentionPolicy | None, steps: Sequence[int], protect: Collection[int] = ()) -> list[int]:
    """Steps the policy lets go among ``steps`` (good ones only: a step known bad neither
    counts towards the policy nor is deleted by it). The newest step and ``protect`` (the
    step just committed, the step the job restored from) are never among them, whatever
    their step numbers say: a root may hold higher steps from an earlier run."""
    if policy is None or not steps:
        return []
    kept = policy.keep(steps) | {max(steps)} | set(protect)
    return [s for s in steps if s not in kept]

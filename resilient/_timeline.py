"""A run's story from its event log: incarnations, recoveries, and goodput.

**Goodput** = time spent in steps whose results were kept / wall time of the run.

* Wall time runs from the first event in the log to the last.
* Rank 0 of every incarnation (one worker process; a restart is a new one) reports each
  step as it completes (the ``step`` event of ``Checkpointer.save``). A step's time is the
  gap since the incarnation's previous step, or since its restore for the first one.
* When an incarnation restores step *r*, every step above *r* completed by earlier
  incarnations was lost: it is trained again, and its time does not count. What remains at
  the end was kept.

So time lost to a failure is the redone steps plus everything that was not a step: fault
detection, re-forming the gang, restarting processes, restoring, and checkpoint stalls
beyond a step's own time.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable


@dataclass
class Incarnation:
    """One rank-0 worker process: from its restore to its last step."""

    pid: int
    started: float                   # its first event
    restored: int = 0
    restored_at: float | None = None
    source: str | None = None
    steps: list[tuple[int, float]] = field(default_factory=list)  # (step, completed at)

    @property
    def first_step_at(self) -> float | None:
        return self.steps[0][1] if self.steps else None


@dataclass
class Timeline:
    start: float
    end: float
    incarnations: list[Incarnation]
    notes: list[dict[str, Any]]      # agent events and failures, in time order
    useful_s: float
    redone_steps: int

    @property
    def wall_s(self) -> float:
        return max(self.end - self.start, 0.0)

    @property
    def goodput(self) -> float:
        return self.useful_s / self.wall_s if self.wall_s > 0 else 0.0


def read_events(path: str | os.PathLike[str], skipped: list[int] | None = None) -> list[dict[str, Any]]:
    """Every well-formed event of a JSON-lines event log, in time order; the numbers of the
    lines that are not one go into ``skipped`` (a torn last line, from a process killed
    while writing it, is one of them).

    Why each field is checked: the log is appended to by every process of a run (and may
    be concatenated from several nodes' logs), and one line of another shape, a ``t`` that
    is text say, made the whole timeline fail with a TypeError."""
    events = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            try:
                event = json.loads(line)
            except (ValueError, RecursionError):
                event = None
            if _well_formed(event):
                events.append(event)
            elif skipped is not None and line.strip():
                skipped.append(number)
    events.sort(key=lambda e: e["t"])
    return events


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_text(value: Any) -> bool:
    return isinstance(value, str)


def _is_text_or_none(value: Any) -> bool:
    return value is None or isinstance(value, str)


#: the fields each kind of event is read for, beyond ``event`` and ``t``: (name, check, required)
_FIELDS: dict[str, tuple[tuple[str, Callable[[Any], bool], bool], ...]] = {
    "step": (("step", _is_int, True),),
    "restored": (("step", _is_int, True), ("source", _is_text_or_none, False)),
    "round_formed": (("round", _is_int, True), ("nodes", _is_int, True)),
    "membership_change": (("detail", _is_text_or_none, False),),
    "workers_restarted": (("reason", _is_text, True),),
    "fault": (("kind", _is_text, True), ("target", _is_text_or_none, False)),
    "hang_detected": (("rank", _is_int, True), ("idle_s", _is_number, True), ("limit_s", _is_number, True)),
    "failure_detected": (("rank", _is_int, True), ("detail", _is_text, True)),
    "regrouped": (("gen", _is_int, True), ("world_size", _is_int, True), ("seconds", _is_number, True)),
    "save_failed": (("step", _is_int, True), ("error", _is_text, False)),
}
_COMMON = (("rank", _is_int, False), ("pid", _is_int, False), ("gen", _is_int, False))  # agents' rank: -1


def _well_formed(event: Any) -> bool:
    """An object with a text ``event``, a finite number ``t``, and, for the kinds of event a
    timeline reads, the fields it reads, each of the type it reads them as."""
    if not isinstance(event, dict) or not isinstance(event.get("event"), str) or not _is_number(event.get("t")):
        return False
    for name, check, required in _COMMON + _FIELDS.get(event["event"], ()):
        if (name in event and not check(event[name])) or (required and name not in event):
            return False
    return True


_NOTES = {"membership_change", "round_formed", "workers_restarted", "save_failed", "fault", "hang_detected",
          "failure_detected", "regrouped"}
_DETECTED = ("membership_change", "failure_detected")  # an agent's view, a worker's (in-process)
_FORMED = ("round_formed", "regrouped")


def build(events: Iterable[dict[str, Any]]) -> Timeline:
    events = list(events)
    if not events:
        raise ValueError("the event log is empty")
    incarnations: dict[int, Incarnation] = {}
    notes = []
    kept: dict[int, float] = {}   # step -> seconds it took, for steps whose result survives
    redone = 0
    last_at: dict[int, float] = {}
    for e in events:
        if e["event"] in _NOTES:
            notes.append(e)
        if e.get("rank") != 0 or "pid" not in e or e["event"] in _NOTES:
            continue
        # a process recovered in-process is a new incarnation of the gang (``gen``)
        key = (e["pid"], e.get("gen", 0))
        inc = incarnations.get(key)
        if inc is None:
            inc = incarnations[key] = Incarnation(e["pid"], e["t"])
            last_at[key] = e["t"]
        if e["event"] == "restored":
            inc.restored, inc.restored_at, inc.source = e["step"], e["t"], e.get("source")
            lost = [s for s in kept if s > e["step"]]
            redone += len(lost)
            for s in lost:
                del kept[s]
            last_at[key] = e["t"]
        elif e["event"] == "step":
            if (inc.steps and e["step"] <= inc.steps[-1][0]) or (inc.restored_at is not None and e["step"] <= inc.restored):
                continue  # reported twice, or the restored step itself (a save right after restore)
            inc.steps.append((e["step"], e["t"]))
            kept[e["step"]] = e["t"] - last_at[key]
            last_at[key] = e["t"]
    ordered = sorted(incarnations.values(), key=lambda i: i.started)
    return Timeline(events[0]["t"], events[-1]["t"], ordered, notes, sum(kept.values()), redone)


def recoveries(timeline: Timeline) -> list[dict[str, Any]]:
    """Per incarnation after the first: what interrupted it and how long each phase took."""
    out = []
    for prev, inc in zip(timeline.incarnations, timeline.incarnations[1:]):
        last_step = prev.steps[-1] if prev.steps else (prev.restored, prev.started)
        # the fault that ended ``prev`` (the old gang may finish a step after it)
        faults = [n for n in timeline.notes if n["event"] == "fault" and prev.started <= n["t"]
                  and (inc.restored_at is None or n["t"] <= inc.restored_at)]
        fault = faults[-1] if faults else None
        detected = next((n for n in timeline.notes if n["event"] in _DETECTED
                         and n["t"] >= last_step[1]), None)
        formed = next((n for n in timeline.notes if n["event"] in _FORMED
                       and n["t"] >= (detected or {"t": last_step[1]})["t"]), None)
        out.append({
            "last_step_before": last_step[0], "last_step_at": last_step[1],
            "fault_at": fault["t"] if fault else None,
            "detected_at": detected["t"] if detected else None,
            "cause": detected.get("detail") if detected else None,
            "round_formed_at": formed["t"] if formed else None,
            "nodes_after": formed.get("nodes", formed.get("world_size")) if formed else None,
            "restored": inc.restored, "restored_at": inc.restored_at, "source": inc.source,
            "first_step_at": inc.first_step_at,
            "first_step": inc.steps[0][0] if inc.steps else None,
        })
    return out


def summary(timeline: Timeline) -> dict[str, Any]:
    return {
        "wall_s": round(timeline.wall_s, 3),
        "useful_s": round(timeline.useful_s, 3),
        "goodput": round(timeline.goodput, 4),
        "incarnations": len(timeline.incarnations),
        "redone_steps": timeline.redone_steps,
        "final_step": max((s for inc in timeline.incarnations for s, _ in inc.steps), default=0),
        "recoveries": recoveries(timeline),
    }


def _agent(note: dict[str, Any]) -> str:
    return f"(agent {note.get('node', '?')})"


_NOTE_TEXT = {
    "round_formed": lambda n: f"round {n['round']} formed: {n['nodes']} node(s) {_agent(n)}",
    "membership_change": lambda n: f"detected: {n.get('detail') or n.get('cause')} {_agent(n)}",
    "workers_restarted": lambda n: f"workers restarted ({n['reason']}) {_agent(n)}",
    "fault": lambda n: f"FAULT: {n['kind']} " + (n.get("target") or f"rank {n.get('rank')} at step {n.get('step')}"),
    "hang_detected": lambda n: f"rank {n['rank']} hung: no step for {n['idle_s']:.1f} s (limit {n['limit_s']:.1f} s)",
    "failure_detected": lambda n: f"rank {n['rank']} detected a failure: {n['detail'][:100]}",
    "regrouped": lambda n: f"re-formed in-process: generation {n['gen']}, world size {n['world_size']} "
                           f"({n['seconds']:.2f} s)",
    "save_failed": lambda n: f"save of step {n['step']} failed: {n.get('error', '')[:120]}",
}


def render_text(timeline: Timeline) -> str:
    t0 = timeline.start
    lines = []
    for note in timeline.notes:
        describe = _NOTE_TEXT.get(note["event"])
        text = describe(note) if describe else \
            f"{note['event']}: {json.dumps({k: v for k, v in note.items() if k not in ('t', 'event')})}"
        lines.append((note["t"], text))
    for inc in timeline.incarnations:
        if inc.restored_at is not None:
            what = f"restored step {inc.restored}" + (f" from {inc.source}" if inc.source else "") \
                if inc.restored else "started fresh"
            lines.append((inc.restored_at, f"{what} (worker {inc.pid})"))
        if inc.steps:
            lines.append((inc.steps[0][1], f"first step: {inc.steps[0][0]}"))
            lines.append((inc.steps[-1][1], f"last step: {inc.steps[-1][0]}"))
    lines.sort(key=lambda x: x[0])
    s = summary(timeline)
    out = [f"{t - t0:8.2f} s  {text}" for t, text in lines]
    out.append("")
    out.append(f"goodput {s['goodput']:.1%}: {s['useful_s']:.1f} s of kept steps in {s['wall_s']:.1f} s wall; "
               f"{len(s['recoveries'])} recovery(ies), {s['redone_steps']} step(s) redone, final step {s['final_step']}")
    for r in s["recoveries"]:
        parts = [f"after step {r['last_step_before']}"]
        for key, label in (("fault_at", "fault"), ("detected_at", "detected"), ("round_formed_at", "round formed"),
                           ("restored_at", f"restored step {r['restored']}"), ("first_step_at", "first step")):
            if r[key] is not None:
                parts.append(f"{label} {r[key] - r['last_step_at']:+.2f} s")
        out.append("recovery: " + ", ".join(parts))
    return "\n".join(out)


def plot(timeline: Timeline, path: str) -> None:
    """Step against time, one line per incarnation; recoveries, restores and saves marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = timeline.start
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for inc in timeline.incarnations:
        if inc.steps:
            ax.plot([t - t0 for _, t in inc.steps], [s for s, _ in inc.steps], lw=1.5,
                    label=f"worker {inc.pid}")
        if inc.restored_at is not None and inc.restored:
            ax.plot([inc.restored_at - t0], [inc.restored], "o", color="tab:blue")
    for note in timeline.notes:
        if note["event"] == "membership_change":
            ax.axvline(note["t"] - t0, color="tab:red", ls="--", lw=1)
        elif note["event"] == "round_formed":
            ax.axvline(note["t"] - t0, color="tab:green", ls=":", lw=1)
    s = summary(timeline)
    ax.set_xlabel("seconds since the run started")
    ax.set_ylabel("step")
    ax.set_title(f"goodput {s['goodput']:.1%} · red: fault detected · green: round formed · dot: restore")
    if len(timeline.incarnations) <= 8:
        ax.legend(loc="upper left", fontsize="small")
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)

"""How the ranks of one save agree that it is committed, over the rendezvous store.

Every rank publishes a report (its file's record, what it holds); each leader (one per
storage location) collects every report, assembles the manifest, commits it on its tier and
publishes its outcome; every rank collects the leaders' outcomes. The store, not a
collective, carries it: the writer thread runs it beside training's own collectives, and
every wait has a timeout, so a dead rank becomes a ``CommitError`` rather than a hang.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable

import torch

from ._coord import Coordinator
from ._errors import CommitError
from ._format import FORMAT, VERSION, encode_manifest

__all__ = ["assemble_manifest", "commit_together"]


def commit_together(
    coord: Coordinator,
    seq: int,
    step: int,
    report: dict[str, Any],
    *,
    codec: str,
    timeout: float,
    commit: Callable[[bytes], None],
    discard: Callable[[], None],
    mark: Callable[[str], None],
) -> None:
    """This rank's part in committing save ``seq`` (of ``step``); raises ``CommitError``
    naming the ranks at fault unless every leader committed. ``commit(manifest)`` and
    ``discard()`` act on this leader's storage; ``mark(phase)`` records when a phase ended."""
    coord.publish(f"{seq}/report/{coord.rank}", json.dumps(report).encode())
    if coord.is_leader:
        _commit_as_leader(coord, seq, step, codec, timeout, commit, discard, mark)
    outcomes = _collect(coord, step, [f"{seq}/outcome/{r}" for r in coord.leaders], "the commit", timeout)
    coord.forget(f"{seq}/report/{coord.rank}")
    failures: dict[int, str] = {}
    for raw in outcomes:
        failures.update({int(k): v for k, v in json.loads(raw)["failures"].items()})
    if failures:
        raise CommitError(step, failures)


def _commit_as_leader(coord: Coordinator, seq: int, step: int, codec: str, timeout: float,
                      commit: Callable[[bytes], None], discard: Callable[[], None],
                      mark: Callable[[str], None]) -> None:
    failures: dict[int, str] = {}
    try:
        raws = _collect(coord, step, [f"{seq}/report/{r}" for r in range(coord.world_size)],
                        "every rank's files", timeout)
        mark("reports")
        manifest = assemble_manifest(step, [json.loads(r) for r in raws], codec)
        commit(encode_manifest(manifest))
        mark("manifest")
    except CommitError as exc:
        failures = exc.failures
    except Exception as exc:
        failures = {coord.rank: f"{type(exc).__name__}: {exc}"}
    if failures:
        discard()
    coord.publish(f"{seq}/outcome/{coord.rank}", json.dumps({"failures": failures}).encode())
    coord.forget(f"{seq - 1}/outcome/{coord.rank}")


def _collect(coord: Coordinator, step: int, keys: list[str], what: str, timeout: float) -> list[bytes]:
    try:
        return coord.collect(keys, timeout)
    except Exception as exc:
        raise CommitError(
            step,
            {coord.rank: f"timed out after {timeout:.0f} s waiting for {what} (is a rank dead?): {exc}"},
        ) from exc


def assemble_manifest(step: int, reports: list[dict[str, Any]], codec: str) -> dict[str, Any]:
    """Merge every rank's report into one manifest; raise CommitError on disagreement."""
    failures = {r["rank"]: r["error"] for r in reports if "error" in r}
    if failures:
        raise CommitError(step, failures)
    first = reports[0]
    for r in reports[1:]:
        if r["signature"] != first["signature"]:
            keys = sorted(set(r["meta"]) ^ set(first["meta"])) or sorted(
                k for k in r["meta"] if r["meta"][k] != first["meta"].get(k)
            )
            raise CommitError(
                step,
                {r["rank"]: f"its state differs from rank {first['rank']}'s at {keys[:5]} "
                 "(every rank must save the same names, shapes and dtypes)"},
            )
    tensors: dict[str, dict[str, Any]] = {}
    replicated: dict[str, list[list[Any]]] = {}
    for name, meta in first["meta"].items():
        tensors[name] = {**meta, "boxes": []}
        if meta["layout"] == "replicated" and "same_as" not in meta:
            replicated[name] = []
    files: dict[str, Any] = {}
    for r in reports:
        if r["file"] is not None:
            files[r["file"]] = r["record"]
        for name, start, length, offset in r["replicated"]:
            replicated[name].append([start, r["file"], offset, length])
        for name, offsets, sizes, offset, nbytes in r["shards"]:
            tensors[name]["boxes"].append(
                {"offsets": offsets, "sizes": sizes, "pieces": [[r["file"], offset, nbytes]]}
            )
    for name, parts in replicated.items():
        parts.sort(key=lambda p: p[0])
        shape = tensors[name]["shape"]
        tensors[name]["boxes"] = [
            {"offsets": [0] * len(shape), "sizes": shape, "pieces": [[f, o, n] for _, f, o, n in parts]}
        ]
    for name, meta in tensors.items():  # tied tensors: written once, every name finds the pieces
        if "same_as" in meta:
            meta["boxes"] = tensors[meta["same_as"]]["boxes"]
    return {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "world_size": len(reports),
        "created": time.time(),
        "torch_version": torch.__version__.split("+")[0],
        "codec": codec,
        "files": files,
        "tensors": tensors,
        "ranks": [{"tree": r["tree"], "rng": r["rng"]} for r in reports],
    }

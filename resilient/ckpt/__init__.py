"""resilient-ckpt: inspect, verify, compare, export, prune and copy checkpoints.

ROOT is a local directory or an fsspec URL (s3://bucket/run-42, memory://x, ...). Nothing
read from a checkpoint is ever unpickled or executed. Exit status: 0 success, 1 a problem
found (corruption, a missing step), 2 a usage error, 141 when the reader of the output
stops early (as ``| head`` does).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from typing import Any, Callable, Sequence

from .._catalog import COMMITTED, CORRUPT, Catalog, Entry
from .._format import REMOTE_RECORD, dtype_itemsize
from .._errors import CheckpointCorruptError, StorageError
from .._exit import run_and_exit
from .._policy import KeepLast, to_delete
from .._saved_trees import whole_tree
from .._storage import is_remote, open_storage
from .._transfer import copy_step
from ._export import FORMATS, ExportError, export
from ._render import Progress, human_age, human_bytes, table

__all__ = ["main", "entry"]

PROG = "resilient-ckpt"


class Problem(Exception):
    """A finding that makes the command exit 1 (corruption, a missing step)."""


class Usage(Exception):
    """A wrong argument (exit 2)."""


# -- helpers -----------------------------------------------------------------------------------
def _catalog(url: str, options: dict[str, Any]) -> Catalog:
    storage = open_storage(url, options)
    if not is_remote(url) and not storage.exists(""):
        raise Usage(f"ROOT {url!r} does not exist")
    return Catalog(storage)


def _pick_step(catalog: Catalog, step: int | None) -> int:
    if step is None:
        newest = catalog.newest_consistent()
        if newest is None:
            raise Problem(f"{catalog.storage.url}: no consistent checkpoint")
        return newest
    if step not in catalog.steps():
        raise Problem(f"{catalog.storage.url}: no checkpoint for step {step} (have: {_steps_text(catalog)})")
    return step


def _steps_text(catalog: Catalog) -> str:
    steps = catalog.steps()
    return ", ".join(map(str, steps)) if steps else "none"


def _tier_name(url: str) -> str:
    return url.split("://", 1)[0] if is_remote(url) else "local"


def _values(node: dict[str, Any], path: str = "") -> list[tuple[str, Any]]:
    """Non-tensor leaves of a saved tree, with slash-joined paths."""
    kind = node["t"]
    if kind == "v":
        return [(path, node["v"])]
    if kind in ("obj", "per_rank"):
        return _values(node["sd"], path)
    if kind == "dict":
        return [kv for k, v in node["items"] for kv in _values(v, f"{path}/{k}" if path else str(k))]
    if kind in ("list", "tuple"):
        return [kv for i, v in enumerate(node["items"]) for kv in _values(v, f"{path}/{i}")]
    return []


def _entry_json(e: Entry, tiers: list[str]) -> dict[str, Any]:
    m = e.manifest or {}
    return {"step": e.step, "state": e.state, "tiers": tiers, "bytes": e.nbytes,
            "world_size": m.get("world_size"), "created": m.get("created"), "problem": e.problem}


def _emit_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=1, allow_nan=True)
    sys.stdout.write("\n")


# -- commands ------------------------------------------------------------------------------------
def _tiers(a: argparse.Namespace) -> list[tuple[str, Catalog]]:
    """The root's tier, plus the remote tier a Checkpointer recorded in a local root."""
    catalog = _catalog(a.root, a.storage_options)
    tiers = [(_tier_name(a.root), catalog)]
    if not is_remote(a.root) and catalog.storage.exists(REMOTE_RECORD):
        url = json.loads(catalog.storage.read(REMOTE_RECORD))["url"]
        try:
            remote = Catalog(open_storage(url, a.storage_options))
            remote.steps()
            tiers.append((_tier_name(url), remote))
        except Exception as exc:
            print(f"{PROG}: warning: remote tier {url} not readable ({type(exc).__name__}: {exc}); "
                  "showing the local tier only", file=sys.stderr)
    return tiers


def cmd_ls(a: argparse.Namespace) -> int:
    merged: dict[int, tuple[Entry, list[str]]] = {}
    for name, catalog in _tiers(a):
        for e in catalog.entries(deep=a.verify):
            best, names = merged.get(e.step, (e, []))
            if e.state == COMMITTED:
                names.append(name)
            if best.state != COMMITTED and e.state == COMMITTED:
                best = e
            merged[e.step] = (best, names)
    rows_json = []
    for step in sorted(merged):
        e, names = merged[step]
        rows_json.append(_entry_json(e, names))
    if a.json:
        _emit_json(rows_json)
    elif not rows_json:
        print(f"no checkpoints in {a.root}")
    else:
        rows = [[str(r["step"]), r["state"], ",".join(r["tiers"]) or "-", human_bytes(r["bytes"]) if r["bytes"] else "-",
                 str(r["world_size"] or "-"), human_age(r["created"]), r["problem"] or ""] for r in rows_json]
        table(["STEP", "STATE", "TIERS", "SIZE", "RANKS", "AGE", "PROBLEM"], rows, colour_col=1)
    return 1 if any(r["state"] == CORRUPT for r in rows_json) else 0


def cmd_show(a: argparse.Namespace) -> int:
    catalog = _catalog(a.root, a.storage_options)
    step = _pick_step(catalog, a.step)
    m = catalog.manifest(step)
    tensors = [{"name": n, "dtype": t["dtype"], "shape": t["shape"],
                "bytes": dtype_itemsize(t["dtype"]) * _numel(t["shape"]),
                "shards": len(t["boxes"])} for n, t in m["tensors"].items()]
    values = [{"name": n, "value": v} for n, v in _values(whole_tree(m))]
    if a.json:
        _emit_json({"step": step, "world_size": m["world_size"], "created": m["created"], "codec": m["codec"],
                    "tensors": tensors, "values": values})
        return 0
    total = sum(t["bytes"] for t in tensors)
    print(f"step {step}: {len(tensors)} tensors, {human_bytes(total)}, written by {m['world_size']} rank(s), "
          f"{human_age(m['created'])}, codec {m['codec']}\n")
    table(["TENSOR", "DTYPE", "SHAPE", "SIZE", "SHARDS"],
          [[t["name"], t["dtype"], "×".join(map(str, t["shape"])) or "scalar", human_bytes(t["bytes"]),
            str(t["shards"])] for t in tensors])
    if values:
        print()
        table(["VALUE", ""], [[v["name"], json.dumps(v["value"])[:80]] for v in values])
    return 0


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def cmd_verify(a: argparse.Namespace) -> int:
    catalog = _catalog(a.root, a.storage_options)
    steps = [_pick_step(catalog, a.step)] if (a.step is not None or not a.all) else catalog.steps()
    if not steps:
        raise Problem(f"{catalog.storage.url}: no checkpoints to verify")
    bad = 0
    for step in steps:
        try:
            total = catalog.entry(step).nbytes
        except Exception:
            total = 0
        progress = Progress(f"verify step {step}", total)
        entry = catalog.entry(step, deep=True, progress=progress)
        if entry.state == COMMITTED:
            progress.finish(f"step {step}: ok, every checksum matches")
        else:
            bad += 1
            progress.finish(f"step {step}: {entry.state.upper()}: {entry.problem}")
    if bad:
        raise Problem(f"{bad} of {len(steps)} checkpoint(s) failed verification")
    return 0


def cmd_diff(a: argparse.Namespace) -> int:
    catalog = _catalog(a.root, a.storage_options)
    sa, sb = _pick_step(catalog, a.a), _pick_step(catalog, a.b)
    ma, mb = catalog.manifest(sa), catalog.manifest(sb)
    ta, tb = ma["tensors"], mb["tensors"]
    added = sorted(set(tb) - set(ta))
    removed = sorted(set(ta) - set(tb))
    changed, same = [], 0
    for name in sorted(set(ta) & set(tb)):
        if (ta[name]["dtype"], ta[name]["shape"]) != (tb[name]["dtype"], tb[name]["shape"]):
            changed.append({"name": name, "from": f"{ta[name]['dtype']}{ta[name]['shape']}",
                            "to": f"{tb[name]['dtype']}{tb[name]['shape']}", "max_abs_diff": None})
            continue
        import torch  # only diff and export compare or write tensors; the other commands need no torch

        x, y = catalog.read_tensor(ma, sa, name), catalog.read_tensor(mb, sb, name)
        if torch.equal(x, y):
            same += 1
            continue
        diff = (x.double() - y.double()).abs().max().item() if x.numel() and x.dtype != torch.bool else None
        changed.append({"name": name, "from": None, "to": None, "max_abs_diff": diff})
    va, vb = dict(_values(whole_tree(ma))), dict(_values(whole_tree(mb)))
    values = [{"name": k, "a": va.get(k), "b": vb.get(k)} for k in sorted(set(va) | set(vb)) if va.get(k) != vb.get(k)]
    if a.json:
        _emit_json({"a": sa, "b": sb, "added": added, "removed": removed, "changed": changed,
                    "unchanged": same, "values_changed": values})
        return 0
    print(f"step {sa} -> step {sb}: {len(added)} added, {len(removed)} removed, {len(changed)} changed, "
          f"{same} unchanged tensors; {len(values)} values changed")
    rows = [[n, "added", ""] for n in added] + [[n, "removed", ""] for n in removed]
    for c in changed:
        detail = f"{c['from']} -> {c['to']}" if c["from"] else (
            f"max |a-b| = {c['max_abs_diff']:.6g}" if c["max_abs_diff"] is not None else "differs")
        rows.append([c["name"], "changed", detail])
    rows += [[v["name"], "changed", f"{json.dumps(v['a'])} -> {json.dumps(v['b'])}"[:80]] for v in values]
    if rows:
        print()
        table(["NAME", "CHANGE", "DETAIL"], rows, colour_col=1)
    return 0


def cmd_export(a: argparse.Namespace) -> int:
    if is_remote(a.out):
        raise Usage(f"OUT must be a local path, got {a.out!r}")
    catalog = _catalog(a.root, a.storage_options)
    step = _pick_step(catalog, a.step)
    m = catalog.manifest(step)
    total = sum(_numel(t["shape"]) * dtype_itemsize(t["dtype"])
                for t in m["tensors"].values())
    progress = Progress(f"export step {step}", total)
    export(catalog, step, a.format, a.out, key=a.key, progress=progress)
    progress.finish(f"exported step {step} as {a.format} to {a.out}")
    return 0


def cmd_prune(a: argparse.Namespace) -> int:
    if (a.keep is None) == (a.after is None):
        raise Usage("give one of --keep K and --after STEP")
    if a.keep is not None and a.keep < 1:
        raise Usage(f"--keep must be >= 1, got {a.keep}")
    if a.after is not None and a.after < -1:  # -1: every checkpoint, step 0's too
        raise Usage(f"--after must be >= -1 (-1 deletes every checkpoint), got {a.after}")
    catalog = _catalog(a.root, a.storage_options)
    entries = catalog.entries()
    consistent = [e.step for e in entries if e.state == COMMITTED]
    if a.after is not None:  # a rollback's abandoned steps, whatever their state: none is to be resumed from
        doomed = sorted(e.step for e in entries if e.step > a.after)
        consistent_left = [s for s in consistent if s <= a.after]
    else:
        doomed = to_delete(KeepLast(a.keep), consistent)
        consistent_left = [s for s in consistent if s not in doomed]
    for step in doomed:
        if not a.dry_run:
            catalog.delete_step(step)
        print(f"{'would delete' if a.dry_run else 'deleted'} step {step}")
    print(f"{len(doomed)} checkpoint(s) {'to delete' if a.dry_run else 'deleted'}, "
          f"{len(consistent_left)} kept (newest consistent: {max(consistent_left) if consistent_left else 'none'})")
    return 0


def _copy(src_url: str, dst_url: str, a: argparse.Namespace) -> int:
    src = _catalog(src_url, a.storage_options)
    dst = open_storage(dst_url, a.storage_options)
    steps = [_pick_step(src, a.step)] if a.step is not None else [
        e.step for e in src.entries() if e.state == COMMITTED]
    if not steps:
        raise Problem(f"{src.storage.url}: no committed checkpoint to copy")
    have = set(Catalog(dst).steps()) if dst.exists("") else set()
    for step in steps:
        if step in have and Catalog(dst).entry(step).state == COMMITTED and not a.force:
            print(f"step {step}: already at {dst.url}, skipped (--force to copy again)")
            continue
        progress = Progress(f"copy step {step}", src.entry(step).nbytes)
        copy_step(src, dst, step, progress)
        progress.finish(f"step {step}: copied to {dst.url}, verified")
    return 0


def cmd_pull(a: argparse.Namespace) -> int:
    return _copy(a.url, a.root, a)


def cmd_push(a: argparse.Namespace) -> int:
    return _copy(a.root, a.url, a)


def cmd_timeline(a: argparse.Namespace) -> int:
    from .. import _timeline

    skipped: list[int] = []
    events = _timeline.read_events(a.log, skipped)
    if skipped:
        print(f"{PROG}: warning: {a.log}: skipped {len(skipped)} line(s) that are not events of the expected "
              f"shape (line {', '.join(map(str, skipped[:5]))}{', ...' if len(skipped) > 5 else ''})", file=sys.stderr)
    if not events:
        raise Problem(f"{a.log}: no events (is RESILIENT_EVENT_LOG / events= pointing here?)")
    timeline = _timeline.build(events)
    if a.json:
        print(json.dumps(_timeline.summary(timeline), indent=1))
    else:
        print(_timeline.render_text(timeline))
    if a.png:
        _timeline.plot(timeline, a.png)
        if not a.json:
            print(f"plot written to {a.png}")
    return 0


# -- parser --------------------------------------------------------------------------------------
def _options(raw: str | None) -> dict[str, Any]:
    if raw is None:
        return {}
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--storage-options is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("--storage-options must be a JSON object")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--storage-options", type=_options, default={}, metavar="JSON",
                        help="fsspec options for remote URLs (credentials also come from the environment)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, fn: Callable[[argparse.Namespace], int], help: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, parents=[common], help=help, description=help)
        sp.set_defaults(fn=fn)
        return sp

    sp = add("ls", cmd_ls, "list checkpoints: step, state, tiers, size, world size, age")
    sp.add_argument("root", metavar="ROOT")
    sp.add_argument("--json", action="store_true", help="machine-readable output")
    sp.add_argument("--verify", action="store_true", help="check every checksum too (reads everything)")
    sp = add("show", cmd_show, "tensors (name, dtype, shape, bytes, shards) and values of one checkpoint")
    sp.add_argument("root", metavar="ROOT")
    sp.add_argument("--step", type=int, help="default: the newest consistent step")
    sp.add_argument("--json", action="store_true")
    sp = add("verify", cmd_verify, "re-check every checksum; exit 1 naming the step when anything is bad")
    sp.add_argument("root", metavar="ROOT")
    sp.add_argument("--step", type=int, help="default: the newest consistent step")
    sp.add_argument("--all", action="store_true", help="every step")
    sp = add("diff", cmd_diff, "what changed between two steps")
    sp.add_argument("root", metavar="ROOT")
    sp.add_argument("a", type=int, metavar="A")
    sp.add_argument("b", type=int, metavar="B")
    sp.add_argument("--json", action="store_true")
    sp = add("export", cmd_export, "one consolidated, world-size-free file (or directory for dcp)")
    sp.add_argument("root", metavar="ROOT")
    sp.add_argument("out", metavar="OUT")
    sp.add_argument("--format", required=True, choices=FORMATS)
    sp.add_argument("--step", type=int, help="default: the newest consistent step")
    sp.add_argument("--key", help="export only this top-level entry (e.g. model), names relative to it")
    sp = add("prune", cmd_prune, "delete all but the newest K consistent checkpoints, or every one after STEP")
    sp.add_argument("root", metavar="ROOT")
    sp.add_argument("--keep", type=int, metavar="K", help="keep the newest K consistent checkpoints")
    sp.add_argument("--after", type=int, metavar="STEP",
                    help="delete every checkpoint after STEP: the steps a rollback to STEP abandons, which a "
                         "restart would otherwise resume from (-1: every checkpoint)")
    sp.add_argument("--dry-run", action="store_true", help="only say what would be deleted")
    sp = add("timeline", cmd_timeline, "a run's recovery timeline and goodput, from its event log")
    sp.add_argument("log", metavar="RUN_LOG", help="the JSON-lines event log (RESILIENT_EVENT_LOG)")
    sp.add_argument("--json", action="store_true", help="summary and recoveries as JSON")
    sp.add_argument("--png", metavar="PATH", help="also plot step progress with faults, rounds and restores")
    for name, fn, first, second in (("pull", cmd_pull, "url", "root"), ("push", cmd_push, "root", "url")):
        sp = add(name, fn, f"copy committed checkpoints {'from URL to ROOT' if name == 'pull' else 'from ROOT to URL'}, verified")
        sp.add_argument(first, metavar=first.upper())
        sp.add_argument(second, metavar=second.upper())
        sp.add_argument("--step", type=int, help="default: every committed step")
        sp.add_argument("--force", action="store_true", help="copy steps the destination already has")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.fn(args)
    except Usage as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # the reader went away (``resilient-ckpt show ... | head``): like any filter cut
        # short, stop quietly with the status a SIGPIPE would give, not an error message
        return 128 + signal.SIGPIPE
    except (Problem, CheckpointCorruptError, FileNotFoundError, StorageError, ExportError, OSError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        # an object store's client raises its own types (botocore's NoCredentialsError,
        # EndpointConnectionError, ...), which share no base with OSError: said as an error
        # about that store, not as a traceback. Anything else is a bug and keeps its traceback.
        remote = next((url for url in _urls_of(args) if is_remote(url)), None)
        if remote is None:
            raise
        print(f"{PROG}: error: {remote}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


def _urls_of(args: argparse.Namespace) -> list[str]:
    """The roots and URLs a command was given, in the order given."""
    return [getattr(args, name) for name in ("root", "url") if isinstance(getattr(args, name, None), str)]


def entry() -> None:
    """The ``resilient-ckpt`` command: ``main``, then exit without the interpreter's teardown
    (see ``_exit``: most of a quick ``diff``'s time once torch is loaded; the other commands
    do not load it)."""
    run_and_exit(main)

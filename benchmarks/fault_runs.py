"""The command-line half shared by the fault benchmarks: run, keep every run, print a table."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable, Iterator

from resilient.devservices import EtcdServer

Runs = list[dict[str, Any]]


def add_output_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", default=None, help="also write every run here")
    parser.add_argument("--render", default=None, help="print the table of runs saved with --json, run nothing")


def render_or_run(args: argparse.Namespace, table: Callable[[Runs], str],
                  runs: Callable[[EtcdServer], Iterator[dict[str, Any]]]) -> None:
    """``--render FILE``: print its table. Otherwise run (one etcd for all runs), echo each
    run to stderr as it ends, save them with ``--json``, and print the table."""
    if args.render:
        with open(args.render) as f:
            print(table(json.load(f)))
        return
    etcd = EtcdServer().start()
    done: Runs = []
    try:
        for run in runs(etcd):
            done.append(run)
            print(json.dumps(run), file=sys.stderr, flush=True)
    finally:
        etcd.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(done, f, indent=1)
    print(table(done))

"""Render this folder's manifests with a values file: ``${NAME}`` → its value.

    python launchers/kubernetes/render.py values.env [etcd.yaml jobset.yaml ...] > all.yaml

Fails naming the file and the variable when a value is missing, rather than emitting a
manifest with a hole in it.
"""

from __future__ import annotations

import os
import re
import string
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
MANIFESTS = ["etcd.yaml", "secret.example.yaml", "jobset.yaml"]


def read_values(path: str) -> dict[str, str]:
    values = {}
    with open(path) as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            name, sep, value = line.partition("=")
            if not sep or not re.fullmatch(r"[A-Z_][A-Z0-9_]*", name):
                raise SystemExit(f"{path}:{number}: expected NAME=value, got {line!r}")
            values[name] = value
    return values


def render(manifest: str, values: dict[str, str]) -> str:
    with open(os.path.join(HERE, manifest)) as f:
        text = f.read()
    # shell variables inside scripts ($PEERS, $HOSTNAME) are not ours: only ${NAME} is
    template = string.Template(text.replace("$", "$$").replace("$${", "${"))
    try:
        return template.substitute(values)
    except KeyError as exc:
        raise SystemExit(f"{manifest}: no value for ${{{exc.args[0]}}} in the values file") from None


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit(__doc__)
    values = read_values(argv[0])
    print("\n---\n".join(render(m, values).strip() for m in (argv[1:] or MANIFESTS)))


if __name__ == "__main__":
    main(sys.argv[1:])

"""The saved structure of a checkpoint as one tree, from its ranks' trees.

Each rank's manifest record holds the tree of the state it saved. Under data parallelism
(DDP, FSDP, HSDP) the trees are alike and kept once. Under pipeline parallelism each stage
saves its own layers' names (the full model's names, as ``torch.distributed.pipelining``
keeps them): the checkpoint's structure is then the union of the ranks' trees. A rank that
restores after a new split, and a reader that consolidates (``resilient-ckpt export``,
``show``), must see names another rank saved. Pure JSON: no torch here.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["merged", "partitioned_entries", "whole_tree"]


def merged(nodes: list[dict[str, Any]], path: str = "") -> tuple[dict[str, Any], str | None]:
    """(one node holding every name of ``nodes``, the path of the first place where they
    disagree on more than which names they hold, or None). Dicts and objects' state dicts
    are joined key by key, and optimizer parameter groups group by group; where nodes of
    other kinds differ (a value, another list), the first wins: pass this rank's first."""
    first = nodes[0]
    rest = [node for node in nodes[1:] if node is not first and node != first]
    if not rest:
        return first, None
    kind = first.get("t")
    if kind == "dict" and all(node.get("t") == "dict" for node in rest):
        children: dict[str, tuple[Any, list[dict[str, Any]]]] = {}
        for node in (first, *rest):
            for key, child in node["items"]:
                children.setdefault(json.dumps(key), (key, []))[1].append(child)
        items, disagreed = [], None
        for key, kids in children.values():
            child, where = merged(kids, f"{path}/{key}" if path else str(key))
            items.append([key, child])
            disagreed = disagreed or where
        return {**first, "items": items}, disagreed
    if kind == "obj" and all(node.get("t") == "obj" for node in rest):
        state_dict, disagreed = merged([first["sd"], *(node["sd"] for node in rest)], path)
        return {**first, "sd": state_dict}, disagreed
    if all(_param_groups(node) for node in (first, *rest)):
        # each stage's optimizer groups, keyed by parameter name (DCP's get_state_dict):
        # every group kept, so a rank of another split finds its parameters' group
        groups: list[dict[str, Any]] = []
        for node in (first, *rest):
            groups += [group for group in node["items"] if group not in groups]
        return {**first, "items": groups}, None
    return first, path or "/"


def _param_groups(node: dict[str, Any]) -> bool:
    """Whether ``node`` is a list of optimizer parameter groups (dicts with ``params``)."""
    return node.get("t") == "list" and all(
        item.get("t") == "dict" and any(key == "params" for key, _ in item["items"]) for item in node["items"])


def _trees(manifest: dict[str, Any], first: int) -> list[dict[str, Any]]:
    """The ranks' distinct trees (shared objects once), rank ``first``'s first."""
    records = manifest["ranks"]
    order = [records[first]] + [r for i, r in enumerate(records) if i != first]
    seen: dict[int, dict[str, Any]] = {}
    for record in order:
        seen.setdefault(id(record["tree"]), record["tree"])
    return list(seen.values())


def partitioned_entries(manifest: dict[str, Any], rank: int) -> dict[str, tuple[dict[str, Any], str | None]]:
    """Top-level entries whose saved node differs by rank, other than per-rank ones: key ->
    (the union of the ranks' nodes, rank ``rank``'s first; where their values first
    disagree, or None). Empty for a data-parallel checkpoint, whose ranks saved one tree."""
    trees = _trees(manifest, rank if rank < manifest["world_size"] else 0)
    if len(trees) == 1:
        return {}
    by_key: dict[str, list[dict[str, Any]]] = {}
    for tree in trees:
        for key, node in tree["items"]:
            if node.get("t") != "per_rank":
                by_key.setdefault(key, []).append(node)
    out = {}
    for key, nodes in by_key.items():
        node, disagreed = merged(nodes, key)
        if node is not nodes[0] or disagreed or len(nodes) < len(trees):  # or only some ranks saved it
            out[key] = (node, disagreed)
    return out


def whole_tree(manifest: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's structure with every rank's names (rank 0's values where ranks
    disagree): what a consolidating reader rebuilds."""
    return merged(_trees(manifest, 0))[0]

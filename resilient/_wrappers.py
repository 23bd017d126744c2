"""Module wrappers that only prefix their module's keys: checkpoints name the module's own.

Why: ``torch.compile(model)`` and ``DistributedDataParallel(model)`` return wrappers whose
``state_dict`` is the wrapped module's with ``_orig_mod.`` or ``module.`` before every key.
Saved as they are, a checkpoint of a compiled or DDP-wrapped model restored only into a
model wrapped the same way: an evaluation script with the plain model, or a run resumed
without ``torch.compile`` (to debug it), was told the keys are not in the checkpoint. With
``strict=False`` it was worse: nothing matched, nothing was loaded, and the restore
returned the step. DCP's ``get_state_dict`` and Lightning drop these prefixes too.

So a save takes the state of the innermost module, and a restore loads into the level of
the wrapping whose keys the checkpoint holds: the innermost for checkpoints saved this way,
or the wrapper itself for one that an earlier version saved from a wrapper (all its keys
carry the prefix), which then restores as it did before. Blocks compiled one by one inside
a model put the same prefix in the middle of their keys: dropped too (``plain_module_keys``).
"""

from __future__ import annotations

import sys
from typing import Any, Iterable

import torch

from ._generators import stateful_generator
from ._loaders import loader_adapter
from ._zero import zero_adapter

__all__ = ["state_holder", "adapter_for", "plain_module_keys", "load_module_state", "COMPILED_SEGMENT"]

#: (the attribute holding the wrapped module, the prefix its keys get): torch.compile's
#: wrapper, then DDP's and DataParallel's
_BY_ATTRIBUTE = (("_orig_mod", "_orig_mod."), ("module", "module."))


def _wrapper_types() -> dict[type, tuple[str, str]]:
    """The wrappers known here. torch.compile's class is looked up only when its module is
    loaded already: a model compiled in this process has loaded it, and importing it here
    would cost every other process a second (sympy, through torch.fx)."""
    types: dict[type, tuple[str, str]] = {
        torch.nn.parallel.DistributedDataParallel: _BY_ATTRIBUTE[1],
        torch.nn.DataParallel: _BY_ATTRIBUTE[1],
    }
    compiled = _compiled_class()
    if compiled is not None:
        types[compiled] = _BY_ATTRIBUTE[0]
    return types


def _compiled_class() -> type | None:
    """torch.compile's module wrapper, where its module is loaded (see ``_wrapper_types``)."""
    compiled = getattr(sys.modules.get("torch._dynamo.eval_frame"), "OptimizedModule", None)
    return compiled if isinstance(compiled, type) else None


def _levels(obj: Any) -> tuple[list[Any], list[str]]:
    """(the object and each module it wraps, outermost first; the prefix each level adds)."""
    chain, prefixes = [obj], []
    if not isinstance(obj, torch.nn.Module):
        return chain, prefixes
    types = _wrapper_types()
    while True:
        known = next((how for cls, how in types.items() if isinstance(chain[-1], cls)), None)
        inner = getattr(chain[-1], known[0], None) if known is not None else None
        if not isinstance(inner, torch.nn.Module) or len(chain) > 16:
            return chain, prefixes
        chain.append(inner)
        prefixes.append(known[1])


def adapter_for(obj: Any) -> Any | None:
    """What gives and takes ``obj``'s state where the object's own ``state_dict`` cannot, or
    not all of it: a random generator's (``_generators``), a data loader's (``_loaders``), a
    ZeRO optimizer's (``_zero``); None for anything else."""
    for find in (stateful_generator, loader_adapter, zero_adapter):
        adapter = find(obj)
        if adapter is not None:
            return adapter
    return None


def state_holder(obj: Any, saved_keys: Iterable[Any] | None = None) -> Any:
    """The object whose ``state_dict`` a checkpoint holds for entry ``obj``.

    Saving (``saved_keys`` None): the innermost module of a wrapper, else ``obj``.
    Restoring: the outermost level whose keys, prefixes included, all of ``saved_keys``
    (the keys of the saved state dict) start with; the innermost when none does. A random
    generator and a data loader are held by an adapter (``adapter_for``)."""
    adapter = adapter_for(obj)
    if adapter is not None:
        return adapter
    chain, prefixes = _levels(obj)
    if saved_keys is None or len(chain) == 1:
        return chain[-1]
    keys = list(saved_keys)
    for level in range(len(chain) - 1):
        prefix = "".join(prefixes[level:])
        if keys and all(isinstance(k, str) and k.startswith(prefix) for k in keys):
            return chain[level]
    return chain[-1]


#: what a submodule compiled on its own puts in its keys (torch.compile per block)
COMPILED_ATTRIBUTE, COMPILED_SEGMENT = _BY_ATTRIBUTE[0]


def _plain_key(module: torch.nn.Module, key: str, compiled: type) -> str:
    """``key`` of ``module``'s state without the ``_orig_mod`` of each compiled submodule it
    passes through (a child of a plain module that is merely named so stays)."""
    kept, current = [], module
    for part in key.split("."):
        if not (part == COMPILED_ATTRIBUTE and isinstance(current, compiled)):
            kept.append(part)
        current = current._modules.get(part) if isinstance(current, torch.nn.Module) else None
    return ".".join(kept)


def plain_module_keys(module: torch.nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """``module``'s ``state_dict`` with the ``_orig_mod.`` that submodules compiled one by
    one put in the middle of their keys dropped (``layers.0._orig_mod.attn.weight`` becomes
    ``layers.0.attn.weight``). Why: torchtitan's recipe compiles each block on its own, and
    a checkpoint holding those keys restored only into a model compiled the same way, not
    into the plain model of an evaluation or a run without compile (DCP's get_state_dict
    drops them too). One substring test a key when no block is compiled."""
    compiled = _compiled_class()
    if compiled is None or not any(isinstance(key, str) and COMPILED_SEGMENT in key for key in state):
        return state
    return {(_plain_key(module, key, compiled) if isinstance(key, str) else key): value
            for key, value in state.items()}


def load_module_state(module: torch.nn.Module, state: dict[str, Any], strict: bool = True) -> Any:
    """``module.load_state_dict(state)``, each key of ``plain_module_keys`` given back its
    ``_orig_mod.`` where the module's own keys have one (keys saved with it are left as they
    are: a checkpoint of an earlier version)."""
    compiled = _compiled_class()
    live = [key for key in module.state_dict().keys() if COMPILED_SEGMENT in key] if compiled is not None else []
    if live:
        own = {_plain_key(module, key, compiled): key for key in live}
        state = {own.get(key, key): value for key, value in state.items()}
    return module.load_state_dict(state, strict=strict)

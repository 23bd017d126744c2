"""Entry points that run as plain Python when code compiled with ``torch.compile`` calls them.

Why: a training step compiled whole (``torch.compile(train_step)``) that calls
``ckpt.save(step)`` made Dynamo trace into the save, and it failed there with an internal
error (``InternalTorchDynamoError`` at an ``isinstance`` against ``random.Random``): a save
is threads, locks, files and the state's own ``state_dict()`` calls, nothing a graph can
hold. Marked with ``eager_under_compile``, the call is a graph break instead: Dynamo
compiles the step up to it, runs it as plain Python with Dynamo off for everything it
calls, and compiles the rest of the step after it. The optimizer-step gate of overlapped
staging (``_fence``) is marked the same way, since a compiled ``optimizer.step()`` runs
its pre-hooks inside the compiled frame.

Dynamo off means inside ``torch._dynamo.disable``: marking the function alone is not
enough, since Dynamo, having given up on a frame, runs its bytecode as it is and goes on
compiling every frame it calls (tried: it compiled the save's helpers one by one and failed
in the same place). The call goes through torch's lazy form of ``torch._dynamo.disable``
(it lives in torch's own source tree, where Dynamo does not trace) only where Dynamo is
loaded already or tracing: a program that has not loaded it (an evaluation script; torch
2.13's optimizers load it at their first step) does not load it for this, which costs
1.4 s (sympy, through torch.fx). Where it is loaded, a call costs 2 us more (a save that
is not due: 4.3 us against 2.3). With ``fullgraph=True`` the graph break is an error, as
it is for any function Dynamo may not trace.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable, TypeVar

import torch

__all__ = ["eager_under_compile"]

F = TypeVar("F", bound=Callable[..., Any])


def eager_under_compile(fn: F) -> F:
    """``fn`` as it is, except that under ``torch.compile`` it runs outside the graph."""
    lazy_disable = getattr(torch, "_disable_dynamo", None)
    is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    if lazy_disable is None or is_compiling is None:  # a torch without them has no Dynamo to keep out
        return fn
    outside = lazy_disable(fn)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if is_compiling() or "torch._dynamo" in sys.modules:
            return outside(*args, **kwargs)
        return fn(*args, **kwargs)

    return call  # type: ignore[return-value]

"""The elastic half: the ``etcd-v3`` rendezvous, the ``resilient-run`` launcher, gang fencing.

Submodules are imported on use: workers only need :mod:`resilient.launch.gang`, which must
not pull in torch's elastic agent.
"""

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters


def _create_etcd_v3(params: "RendezvousParameters") -> "RendezvousHandler":
    from .rendezvous import create_handler

    return create_handler(params)


def handler_entry_point() -> Callable[["RendezvousParameters"], "RendezvousHandler"]:
    """The ``torchrun.handlers`` entry point (``etcd-v3``): torch calls it when its
    rendezvous registry is first imported and registers what it returns. It lives here, not
    in ``rendezvous``, and returns a creator that imports the handler only when a rendezvous
    is made: the handler's module itself imports torch's registry, so loading it from the
    entry point would find it half-imported whenever it is the first to be imported."""
    return _create_etcd_v3

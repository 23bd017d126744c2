"""How ranks agree: on who commits, on which step to restore, and on save outcomes.

Two channels, each used from one thread only:

* the **process group** (main thread): short collectives inside calls that are collective
  anyway (construction, restore, the time-based save decision);
* the **rendezvous key-value store** (the background writer): per-save reports and
  outcomes. A store, unlike a collective, has no ordering constraint with the training
  loop's own collectives and every wait has a timeout, so a dead rank turns into a
  ``CommitError`` rather than a hang. The writer reaches it over a connection of its own
  (``_own_connection``), so that its long waits never hold anyone else's requests.

``SoloCoordinator`` is the same contract for one process without torch.distributed.
"""

from __future__ import annotations

import os
import uuid
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

__all__ = ["Coordinator", "SoloCoordinator", "StoreCoordinator", "GroupCoordinator", "make_coordinator"]


class Markers(Protocol):
    """Storage-side half of leader election: which ranks see the same directory."""

    def write_marker(self, session: str, rank: int) -> None: ...
    def visible_markers(self, session: str) -> list[int]: ...
    def remove_marker(self, session: str, rank: int) -> None: ...


class Coordinator:
    """The contract. ``leader`` is the rank that commits to the storage this rank writes to."""

    rank: int = 0
    world_size: int = 1
    leader: int = 0
    leaders: list[int] = [0]
    #: the ranks whose leader is this rank's, all of them writing to its storage (known to a
    #: leader that needs it: whose files to keep at its root; empty where not known)
    sharing: list[int] = [0]
    session: str = ""

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader

    # -- main thread: collectives ---------------------------------------------------------
    def agree_min(self, value: int) -> int:
        return value

    def agree_max(self, value: int) -> int:
        return value

    def agree_max_many(self, values: list[int]) -> list[int]:
        """Element-wise maximum over ranks of several values, in one collective."""
        return list(values)

    def agree_max_later(self, values: list[int]) -> list[int] | None:
        """Send ``values`` for an element-wise maximum over ranks without waiting for it, and
        return the maximum of the values sent at the previous call (None at the first). Every
        rank must call it at the same points, as any collective. Here (one process, or no
        process group): the values themselves, at once."""
        return list(values)

    def barrier(self) -> None:
        pass

    def all_gather(self, obj: object) -> list[object]:
        """Every rank's ``obj`` (small, picklable values we built: never checkpoint data)."""
        return [obj]

    #: the device type this group's collectives take tensors on ("cpu" for gloo)
    tensor_device: str = "cpu"

    def broadcast(self, tensor: torch.Tensor, src: int) -> Any:
        """Start broadcasting ``tensor`` from rank ``src``; returns a handle to ``wait()`` on.
        Every rank must start the same broadcasts in the same order."""
        raise NotImplementedError("one process has no one to broadcast to")

    # -- background thread: store ---------------------------------------------------------
    def publish(self, key: str, value: bytes) -> None:
        raise NotImplementedError

    def collect(self, keys: list[str], timeout: float) -> list[bytes]:
        raise NotImplementedError

    def missing(self, keys: list[str]) -> list[str]:
        """Which of ``keys`` are not published (after a ``collect`` timed out: who is late)."""
        raise NotImplementedError

    def forget(self, key: str) -> None:
        pass


class SoloCoordinator(Coordinator):
    def __init__(self) -> None:
        self.session = uuid.uuid4().hex[:12]
        self._values: dict[str, bytes] = {}

    def publish(self, key: str, value: bytes) -> None:
        self._values[key] = value

    def collect(self, keys: list[str], timeout: float) -> list[bytes]:
        return [self._values[k] for k in keys]

    def missing(self, keys: list[str]) -> list[str]:
        return [k for k in keys if k not in self._values]

    def forget(self, key: str) -> None:
        self._values.pop(key, None)


class StoreCoordinator(Coordinator):
    """The store half: ranks that know who they are and share a key-value store. A
    ``GroupCoordinator`` is one once its collectives have settled who leads; the commit
    benchmark builds thousands of them, one per simulated rank, on one real store.

    Values of any size: torch's TCPStore refuses a value over 8 MB (the connection is reset),
    and a manifest of a few hundred FSDP ranks is larger, so a large value goes as parts of
    ``PART_BYTES`` written before the key that names their count. Each stored value starts
    with one byte saying which: ``=`` the value follows, ``#`` the count of parts follows."""

    PART_BYTES = 4 << 20
    #: keys per ``multi_get``: one answer stays a few MB however many ranks report
    KEYS_PER_REQUEST = 128

    def __init__(self, store: dist.Store, *, rank: int, world_size: int, leader: int, leaders: list[int],
                 session: str, sharing: list[int] | None = None) -> None:
        self._store = store
        self._parts: dict[str, int] = {}  # keys this rank published in parts: how many
        self.rank, self.world_size, self.leader, self.leaders, self.session = (
            rank, world_size, leader, leaders, session)
        self.sharing = list(sharing or [])

    def publish(self, key: str, value: bytes) -> None:
        if len(value) <= self.PART_BYTES:
            self._store.set(key, b"=" + value)
            return
        view = memoryview(value)
        count = -(-len(value) // self.PART_BYTES)
        for i in range(count):
            self._store.set(f"{key}#{i}", bytes(view[i * self.PART_BYTES:(i + 1) * self.PART_BYTES]))
        self._parts[key] = count
        self._store.set(key, b"#%d" % count)  # last: whoever sees the key finds every part

    def collect(self, keys: list[str], timeout: float) -> list[bytes]:
        self._store.wait(keys, timedelta(seconds=timeout))
        out = []
        for key, raw in zip(keys, self._get_many(keys)):
            if raw[:1] == b"=":
                out.append(raw[1:])
            elif raw[:1] == b"#":
                out.append(b"".join(self._get_many([f"{key}#{i}" for i in range(int(raw[1:]))])))
            else:
                raise ValueError(f"store key {key!r} holds a value resilient did not write")
        return out

    def _get_many(self, keys: list[str]) -> list[bytes]:
        if len(keys) > 1 and hasattr(self._store, "multi_get"):  # torch >= 2.3: one round trip per batch
            step = self.KEYS_PER_REQUEST
            return [v for i in range(0, len(keys), step) for v in self._store.multi_get(keys[i:i + step])]
        return [self._store.get(k) for k in keys]

    def missing(self, keys: list[str]) -> list[str]:
        return [k for k in keys if not self._store.check([k])]

    def forget(self, key: str) -> None:
        try:
            self._store.delete_key(key)
            for i in range(self._parts.pop(key, 0)):
                self._store.delete_key(f"{key}#{i}")
        except Exception:  # a store without delete support just keeps a few bytes
            pass


class GroupCoordinator(StoreCoordinator):
    def __init__(self, group: dist.ProcessGroup | None, markers: Markers) -> None:
        self.group = group
        rank = dist.get_rank(group)
        world_size = dist.get_world_size(group)
        backend = dist.get_backend(group)
        self._device = (
            torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        )
        self.tensor_device = self._device.type
        box = [uuid.uuid4().hex[:12] if rank == 0 else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group else 0, group=group)
        session = str(box[0])
        # Ranks that see each other's marker files share storage; the lowest one commits.
        # This is right for one machine, for node-local disks, and for a shared filesystem.
        markers.write_marker(session, rank)
        self.barrier()
        leader = min(markers.visible_markers(session))
        self.barrier()
        markers.remove_marker(session, rank)
        everyone: list[int | None] = [None] * world_size
        dist.all_gather_object(everyone, leader, group=group)
        super().__init__(dist.PrefixStore(f"resilient/{session}/", _own_connection(_default_store())),
                         rank=rank, world_size=world_size, leader=leader,
                         leaders=sorted({int(x) for x in everyone if x is not None}), session=session,
                         sharing=[r for r, x in enumerate(everyone) if x == leader])

    def _reduce(self, value: int, op: dist.ReduceOp) -> int:
        return self._reduce_many([value], op)[0]

    def _reduce_many(self, values: list[int], op: dist.ReduceOp) -> list[int]:
        t = torch.tensor(values, dtype=torch.int64, device=self._device)
        dist.all_reduce(t, op=op, group=self.group)
        return [int(v) for v in t.tolist()]

    def agree_max_many(self, values: list[int]) -> list[int]:
        return self._reduce_many(values, dist.ReduceOp.MAX)

    def agree_max_later(self, values: list[int]) -> list[int] | None:
        """A question asked at every step (is any rank being preempted?): waiting for its
        answer in the same call costs a round trip over the ranks each time, and on an
        accelerator a host sync, which stops the host from queueing the next step's work
        while the device finishes this one. Read one call later, the answer has long
        arrived: the wait (``_Later.result``) covers only work queued before the previous
        call, with a step of the device's work still queued behind it."""
        previous, self._later = getattr(self, "_later", None), None
        agreed = previous.result() if previous is not None else None
        t = torch.tensor(values, dtype=torch.int64, device=self._device)
        work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        self._later = _Later(work, t)
        return agreed

    def agree_min(self, value: int) -> int:
        return self._reduce(value, dist.ReduceOp.MIN)

    def agree_max(self, value: int) -> int:
        return self._reduce(value, dist.ReduceOp.MAX)

    def barrier(self) -> None:
        self.agree_min(0)  # a reduce is a barrier that works on every backend

    def all_gather(self, obj: object) -> list[object]:
        out: list[object] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast(self, tensor: torch.Tensor, src: int) -> Any:
        return dist.broadcast(tensor, src=dist.get_global_rank(self.group, src) if self.group else src,
                              group=self.group, async_op=True)


class _Later:
    """An all-reduce in flight and where its answer will be read: the tensor itself on the
    CPU, a pinned copy on an accelerator, made after the collective on the current stream
    and marked by an event, so that reading it waits for that point of the stream only."""

    def __init__(self, work: Any, reduced: torch.Tensor) -> None:
        self._work, self._reduced, self._event = work, reduced, None
        if reduced.is_cuda:
            work.wait()  # the current stream waits for the collective: the host does not
            self._reduced = torch.empty(reduced.shape, dtype=reduced.dtype, device="cpu", pin_memory=True)
            self._reduced.copy_(reduced, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    def result(self) -> list[int]:
        if self._event is not None:
            self._event.synchronize()
        else:
            self._work.wait()
        return [int(v) for v in self._reduced.tolist()]


def _default_store() -> dist.Store:
    # The store every launcher (torchrun, resilient-run, init_method=tcp/env) already
    # created for init_process_group; reusing it avoids opening another port.
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def _own_connection(store: dist.Store) -> dist.Store:
    """The same store over a connection of the writer's own.

    Why: a TCPStore client serves one request at a time, and the writer's ``wait`` for the
    other ranks' reports holds it for as long as a dead rank keeps them away (the commit
    timeout: 600 s by default). On a shared client, everything else this process asks of
    the store waits that long too: ``@resilient.elastic``'s re-forming after the peer's
    death (the regroup store is that client) stalled 20 s with a 20 s timeout, where it
    takes 0.1 s. One more connection per rank to the store's host is the price. Stores
    that cannot be cloned (a FileStore; torch < 2.3) are shared as before."""
    try:
        return store.clone()
    except (AttributeError, RuntimeError, NotImplementedError):
        return store


def make_coordinator(group: dist.ProcessGroup | None, markers: Markers) -> Coordinator:
    """A group coordinator when torch.distributed is initialised, else a solo one.

    Refused: a solo one in a process a launcher started as one rank of several (torchrun and
    resilient-run set ``WORLD_SIZE``), made before ``init_process_group``. Every rank then
    saved as if alone, into the same root, and failed on whichever rank lost the race, with
    errors about another job holding the root or a directory that is not empty."""
    if dist.is_available() and dist.is_initialized():
        return GroupCoordinator(group, markers)
    world = os.environ.get("WORLD_SIZE", "1")
    if world.isdigit() and int(world) > 1:
        raise RuntimeError(
            f"Checkpointer made on rank {os.environ.get('RANK', '?')} of WORLD_SIZE={world} before "
            "torch.distributed.init_process_group(): every rank would save as if alone, into the same root. "
            "Initialise the process group first (a Checkpointer's save and restore are collective)")
    return SoloCoordinator()

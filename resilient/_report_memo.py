"""What a rank need not send rank 0 again: the pieces of its report that are as they were
at the last save that committed everywhere.

Why: an FSDP rank's report is mostly its tensors' names and shapes, its tree and its boxes
(5.2 of 5.5 kB deflated), a DDP rank's where in its file its parts of the replicated tensors
are, and none of them changes from one save to the next; only its file's record and where
its generators' states are do. At 8,192 ranks that is 45 MB through
the store to rank 0 at every save, and rank 0 finding the runs of 2.4 million boxes again,
in its writer thread beside training (``bench_manifest``). A rank whose piece is byte for
byte what rank 0 already holds sends the piece's digest instead, and rank 0 reuses what it
made of those pieces (the boxes' runs) when no rank's changed.

Why it cannot go wrong silently: both sides move to a new baseline on one fact they share,
the save's settlement (rank 0 on the one it publishes, every rank on the one it reads), and
both drop it on any failure, so the next save after a failure is sent whole. A digest that
rank 0 does not hold (a baseline the two sides somehow disagree on) fails that one save,
naming the rank, and the one after it is sent whole: never a manifest made of stale pieces.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable

__all__ = ["KEPT_PIECES", "HeldPieces", "SentPieces"]

#: The report's pieces that are the same save after save on a rank (``_commit.encode_report``
#: names them so): its tensors' metadata, its tree, its sharded boxes' rows, and where in its
#: file its parts of replicated tensors are.
KEPT_PIECES = ("meta", "tree", "rows", "replicated")


#: The pieces alike on every rank of an FSDP job, kept once however many ranks sent them
#: (each rank's boxes and parts differ, and are kept as they came).
_ALIKE = ("meta", "tree")

#: Each sharded tensor's boxes as ``_commit`` encodes them for the manifest, runs found.
Boxes = dict[str, list[bytes]]
#: Every rank's data file (None for a rank without one), and the manifest's encoded
#: tensors section that names them.
Tensors = tuple[tuple["str | None", ...], bytes]


def digest(piece: bytes) -> str:
    """A piece's name in a report that leaves it out: hashed by the rank that sends it,
    compared by rank 0."""
    return hashlib.blake2b(piece, digest_size=12).hexdigest()


class SentPieces:
    """A rank's side: what rank 0 holds of its report since the last save that committed."""

    def __init__(self) -> None:
        self._held: dict[str, tuple[bytes, str]] = {}  # kind -> (its bytes, its digest), as rank 0 holds them
        self._sending: dict[str, tuple[bytes, str]] = {}
        self._encoded: dict[str, tuple[Any, bytes]] = {}  # kind -> (the value, its encoding)

    def encoded(self, kind: str, value: Any, encode: Callable[[Any], bytes]) -> bytes:
        """``encode(value)``, reused while ``value`` is the very object encoded last time
        (held here, so that its id cannot be another's): a rank's save plan is kept from
        save to save while its layout does not change, and with it its tensors' metadata
        and its parts of replicated tensors; encoding them again cost 60 ms of every save
        at 26,800 tensors."""
        last = self._encoded.get(kind)
        if last is None or last[0] is not value:
            last = self._encoded[kind] = (value, encode(value))
        return last[1]

    def left_out(self, kind: str, piece: bytes) -> tuple[bool, str]:
        """(whether ``piece`` can be left out, as rank 0 holds it already; its digest). A
        piece sent whole becomes the baseline if this save commits; its digest goes with it,
        so that rank 0 never hashes what thousands of ranks send.

        ``piece`` as encoded, before it is deflated: rank 0 holds it deflated, but the same
        bytes need not deflate alike twice (ISA-L, under load, now and then), and a piece
        left out is not deflated at all."""
        held = self._held.get(kind)
        if held is not None and held[0] == piece:
            self._sending[kind] = held
            return True, held[1]
        self._sending[kind] = (piece, digest(piece))
        return False, self._sending[kind][1]

    def settled(self, committed: bool) -> None:
        """The settlement this rank read (``committed``: no failures anywhere), or failed to."""
        self._held = self._sending if committed else {}
        self._sending = {}


class HeldPieces:
    """Rank 0's side: every rank's kept pieces as of the last save that committed, and the
    boxes' runs made of them, which a save whose ranks changed none of them reuses."""

    def __init__(self) -> None:
        self._held: dict[int, dict[str, tuple[bytes, str]]] = {}
        self._boxes: Boxes | None = None
        self._tensors: Tensors | None = None
        self._holding: tuple[dict[int, dict[str, tuple[bytes, str]]], Boxes, Tensors] | None = None
        self._interned: dict[bytes, bytes] = {}

    def resolve(self, rank: int, kind: str, named: str) -> bytes:
        """The piece ``rank`` left out, named by its digest; ``ValueError`` when not held."""
        held = self._held.get(rank, {}).get(kind)
        if held is None or held[1] != named:
            raise ValueError(f"its report leaves out its {kind} as sent before (digest {named}), which rank 0 "
                             "does not hold; the next save sends it whole")
        return held[0]

    @property
    def boxes(self) -> Boxes | None:
        """The boxes' runs of the last committed save: this save's too when every rank left
        out its rows and its metadata."""
        return self._boxes

    def tensors(self, files: tuple[str | None, ...]) -> bytes | None:
        """The manifest's encoded tensors section of the last committed save, if its ranks
        wrote the files ``files`` (a rank's name, or None for a rank without one): this
        save's too when every rank left out its metadata, rows and replicated parts."""
        if self._tensors is None or self._tensors[0] != files:
            return None
        return self._tensors[1]

    def propose(self, pieces: dict[int, dict[str, bytes]], named: dict[int, dict[str, str]], boxes: Boxes,
                tensors: Tensors) -> None:
        """What this save's manifest was made of, which becomes the baseline if it commits.
        ``named``: the digests ranks gave for their pieces (hashed here only where a rank
        gave none). ``tensors``: the ranks' files and the tensors section made of them."""
        holding: dict[int, dict[str, tuple[bytes, str]]] = {}
        for rank, kinds in pieces.items():
            names = named.get(rank, {})
            holding[rank] = {kind: (self._interned.setdefault(piece, piece) if kind in _ALIKE else piece,
                                    names.get(kind) or digest(piece))
                             for kind, piece in kinds.items()}
        self._holding = (holding, boxes, tensors)

    def settled(self, committed: bool) -> None:
        """The settlement rank 0 published (``committed``: no failures), or failed to."""
        if committed and self._holding is not None:
            self._held, self._boxes, self._tensors = self._holding
        else:
            self._held, self._boxes, self._tensors = {}, None, None
        self._interned = {kinds[kind][0]: kinds[kind][0] for kinds in self._held.values() for kind in _ALIKE
                          if kind in kinds}
        self._holding = None

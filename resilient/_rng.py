"""Random generator states of one rank, as JSON (no pickle).

Saved by default so that a resumed run draws the same dropout masks and data order as an
uninterrupted one; each rank keeps its own streams. The Mersenne Twister states of Python's
and numpy's generators (624 words each) are kept as base64 of their little-endian words, not
as lists of numbers, and torch's deflated: 10 kB a rank instead of 20, and a string a JSON
reader takes whole rather than parsing 1,250 numbers (states saved as lists are still read).
Since format 3 they are kept in the rank's own data file (``encode_rng``), not in the
manifest: seeded differently, 8,192 ranks' states were 90 of its 100 MB, which every
node's leader received at every save.
"""

from __future__ import annotations

import base64
import json
import random
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["SavedRng", "apply_rng", "capture_rng", "decode_rng", "encode_rng", "parse_rng"]


_DEFLATED = "z:"  # a generator state saved deflated: torch's CPU state is 5 kB, half of it zeros
_MAX_STATE_BYTES = 1 << 20


def _b64(t: torch.Tensor) -> str:
    return _DEFLATED + base64.b64encode(zlib.compress(t.numpy().tobytes(), 9)).decode()


def _tensor(s: str) -> torch.Tensor:
    """A generator state as saved: deflated (bounded: a hostile one cannot inflate past
    1 MiB) or, as older versions wrote it, raw, base64 either way."""
    if s.startswith(_DEFLATED):
        inflate = zlib.decompressobj()
        raw = inflate.decompress(base64.b64decode(s[len(_DEFLATED):]), _MAX_STATE_BYTES)
        if inflate.unconsumed_tail:
            raise ValueError(f"a saved generator state inflates past {_MAX_STATE_BYTES} bytes")
    else:
        raw = base64.b64decode(s)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def _words(values: Any) -> str:
    return base64.b64encode(np.asarray(values, dtype="<u4").tobytes()).decode()


def _from_words(saved: str | list[int]) -> np.ndarray:
    """A generator's words as saved: base64 of little-endian uint32, or (older) a list."""
    if isinstance(saved, str):
        return np.frombuffer(base64.b64decode(saved), dtype="<u4").astype(np.uint32)
    return np.asarray(saved, dtype=np.uint32)


def capture_rng() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": [version, _words(internal), gauss],
        "numpy": [kind, _words(keys), int(pos), int(has_gauss), float(cached)],
        "torch": _b64(torch.get_rng_state()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def encode_rng(state: dict[str, Any]) -> bytes:
    """``capture_rng``'s state as the bytes a data file keeps (JSON)."""
    return json.dumps(state, separators=(",", ":")).encode()


def decode_rng(raw: bytes | bytearray, where: str) -> dict[str, Any]:
    """``encode_rng``'s bytes back; ``ValueError`` naming ``where`` if they are not a state."""
    try:
        state = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise ValueError(f"{where}: the generator states are not JSON ({exc})") from None
    if not isinstance(state, dict):
        raise ValueError(f"{where}: the generator states are not an object")
    return state


@dataclass
class SavedRng:
    """One rank's saved generator states, parsed and checked, ready to apply."""

    python: tuple[Any, ...] | None
    numpy: tuple[Any, ...] | None
    torch: torch.Tensor | None
    cuda: list[torch.Tensor]


def parse_rng(state: dict[str, Any]) -> SavedRng:
    """``state`` (as ``capture_rng`` saved it, in this or an older version) parsed, each
    part tried on a fresh generator of its kind, so that damage raises here (``ValueError``,
    ``TypeError``), while the restore can still fall back to an older step,
    not after the state is loaded, in ``apply_rng``."""
    python = numpy_state = torch_state = None
    if "python" in state:
        version, internal, gauss = state["python"]
        python = (version, tuple(int(w) for w in _from_words(internal)), gauss)
        random.Random().setstate(python)
    if "numpy" in state:
        kind, keys, pos, has_gauss, cached = state["numpy"]
        numpy_state = (kind, _from_words(keys), pos, has_gauss, cached)
        np.random.RandomState().set_state(numpy_state)
    if "torch" in state:
        torch_state = _tensor(state["torch"])
        try:
            torch.Generator().set_state(torch_state)
        except RuntimeError as exc:  # torch's word for a state of the wrong size or kind
            raise ValueError(f"torch's generator state: {exc}") from None
    cuda = [_tensor(s) for s in state.get("cuda") or []]
    return SavedRng(python, numpy_state, torch_state, cuda)


def apply_rng(saved: SavedRng) -> None:
    if saved.python is not None:
        random.setstate(saved.python)
    if saved.numpy is not None:
        np.random.set_state(saved.numpy)
    if saved.torch is not None:
        torch.set_rng_state(saved.torch)
    if saved.cuda and torch.cuda.is_available() and len(saved.cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(saved.cuda)

"""Fused pack/unpack of resharding messages: Triton kernels with a torch fallback.

Public API (importing this package needs neither torch nor triton; the first use
imports torch, and triton only where the kernels run):

    SegmentView(tensor, starts, sizes)        a box of a tensor; a segment may also be a
                                              tensor view or (tensor, index-of-slices)
    layout(views) -> (offsets, nbytes)        where `pack` puts each segment (16-byte aligned)
    pack(segments, out=None, *, key=None) -> uint8 buffer
    unpack(buffer, segments, *, key=None)
    pack_many(messages, *, key=None) -> [uint8 buffer per message]   one launch per round
    unpack_many(buffers, messages, *, key=None)
    copy(pairs, *, key=None)                  local box-to-box copies, one launch
    warm(calls, device)                        compile the kernel variants of pack_into/unpack_from calls
    pack_into(views, offsets, nbytes, out=None) / unpack_from(buffer, views, offsets)
                                              the executor's contract (nereus.runtime.packing)
    Packer(backend=None|"auto"|"triton"|"torch", tile=None, max_vec=2)
                                              the object behind the functions above; the
                                              module functions use one default Packer

Backend choice (`Packer.backend_for`): argument, else NEREUS_PACK_BACKEND, else auto:
Triton on CUDA tensors when triton imports, torch otherwise; logged once on `nereus.pack`.
`key=` caches a call's device tables (see packer.py). Design notes: segments.py (pieces,
alignment), tables.py (tiles), kernels.py (the kernel, and why messages pack bytes).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "SegmentView": "segments",
    "as_view": "segments",
    "layout": "segments",
    "ALIGN": "segments",
    "Packer": "packer",
}
_FUNCTIONS = ("pack", "unpack", "pack_many", "unpack_many", "copy", "pack_into", "unpack_from", "warm")
_default = None

__all__ = sorted(_EXPORTS) + list(_FUNCTIONS) + ["default_packer"]


def default_packer():
    """The Packer behind the module-level functions (created on first use)."""
    global _default
    if _default is None:
        _default = importlib.import_module(f"{__name__}.packer").Packer()
    return _default


def _delegate(name: str):
    def call(*args: Any, **kwargs: Any):
        return getattr(default_packer(), name)(*args, **kwargs)

    call.__name__ = name
    call.__doc__ = f"`Packer.{name}` of the default packer."
    return call


for _name in _FUNCTIONS:
    globals()[_name] = _delegate(_name)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

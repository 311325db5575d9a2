"""Packing of a message's pieces into one flat byte buffer, and unpacking on arrival.

One small interface, `pack(views, offsets, nbytes, out)` / `unpack(buffer, views,
offsets)`, so that the executor can switch to the fused Triton kernels of
`nereus.backends.triton` when they exist (they are used when that package exposes
`pack_into`/`unpack_from` with this signature; otherwise the torch fallback below runs:
one `copy_` per piece into a uint8 buffer viewed as the piece's dtype).

Each piece starts at an 8-byte aligned offset so that a byte buffer can be viewed as
any element type in place; both sides derive the offsets from the same piece list.
"""

from __future__ import annotations

import importlib
import os
from typing import Optional, Sequence

import torch

# the memory model the compiler proves programs under counts pieces at this alignment
from nereus.passes.memory_model import ALIGN


def layout(nbytes: Sequence[int]) -> tuple[tuple[int, ...], int]:
    """Offsets of pieces of the given byte sizes, each aligned to ALIGN, and the total."""
    offsets, at = [], 0
    for n in nbytes:
        offsets.append(at)
        at += (n + ALIGN - 1) // ALIGN * ALIGN
    return tuple(offsets), at


def _chunk(buffer: torch.Tensor, view: torch.Tensor, offset: int) -> torch.Tensor:
    """The region of `buffer` (uint8) that holds `view`, viewed with its dtype and shape."""
    nbytes = view.numel() * view.element_size()
    return buffer[offset : offset + nbytes].view(view.dtype).view(view.shape)


def torch_pack(views: Sequence[torch.Tensor], offsets: Sequence[int], nbytes: int,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    buffer = out if out is not None else torch.empty(nbytes, dtype=torch.uint8, device=views[0].device)
    regions, pieces = _regions(buffer, views, offsets)
    copy_pairs(regions, pieces)
    return buffer


def torch_unpack(buffer: torch.Tensor, views: Sequence[torch.Tensor], offsets: Sequence[int]) -> None:
    regions, pieces = _regions(buffer, views, offsets)
    copy_pairs(pieces, regions)


# below this many pieces a list is copied one `copy_` each (a few large pieces: the
# driver's memcpy, as before); from it on, one `_foreach_copy_`
FOREACH_MIN_PIECES = 16
# ... of pieces below this size only: a large contiguous piece copies faster alone (on an
# H200, dim-0 slices of 8B-shaped weights: 1.90 TB/s with `copy_`, 1.42 TB/s in
# `_foreach_copy_`'s fused kernel; benchmarks/RESULTS.md, "same-GPU copies")
FOREACH_MAX_BYTES = 1 << 20


def copy_all(dsts: list, srcs: list) -> None:
    """dsts[i] <- srcs[i], one dtype and pair of devices (`copy_pairs` groups them): one
    `_foreach_copy_` for many pieces in one memory, one `copy_` each for a few, or where
    they cross memories (host pieces of an offloaded unit and a device buffer). A copy
    between host and device memory is queued (non_blocking) like every other device
    copy: the host reads no host piece before the stream is synchronized (at the commit;
    the executor synchronizes before it checksums host views), and a blocking copy per
    piece kept the host from posting the transfers meanwhile."""
    crossing = dsts and dsts[0].is_cuda != srcs[0].is_cuda
    if len(dsts) >= FOREACH_MIN_PIECES and not crossing:
        torch._foreach_copy_(dsts, srcs)
    else:
        for dst, src in zip(dsts, srcs):
            dst.copy_(src, non_blocking=crossing)


def copy_pairs(dsts: list, srcs: list) -> None:
    """dsts[i] <- srcs[i] for any list of pairs: grouped by dtype, density and the two
    devices, each group by `copy_all` (a C++ loop; on CUDA one fused launch for a list of
    small dense pairs, which one strided view would send down the per-tensor path)
    instead of a Python step and a copy call per piece: an expert-parallel round holds
    thousands of small pieces. A dense pair of FOREACH_MAX_BYTES or more is copied alone
    (`copy_`: the driver's memcpy); a strided pair is copied as the widest integer type
    its rows allow (`widened`). A group whose pairs cross memories (host shards of an
    offloaded or staged unit) is copied one `copy_` each, queued; a strided pair across
    memories with a contiguous side is one kernel launch where the GPU maps the host
    side (`_cross_in_place`: torch would copy it through a temporary on one CPU thread)."""
    groups: dict = {}
    with torch.no_grad():
        for dst, src in zip(dsts, srcs):
            dense = dst.is_contiguous() and src.is_contiguous()
            crossing = dst.device != src.device
            if not dense:
                if crossing and _cross_in_place(dst, src):
                    continue
                dst, src = widened(dst, src)
            elif dst.numel() * dst.element_size() >= FOREACH_MAX_BYTES:
                dst.copy_(src, non_blocking=crossing)
                continue
            key = (src.dtype, dense, dst.device, src.device)
            group = groups.get(key)
            if group is None:
                group = groups[key] = ([], [])
            group[0].append(dst)
            group[1].append(src)
        for group_dsts, group_srcs in groups.values():
            copy_all(group_dsts, group_srcs)


def host_in_place(tensors: Sequence[torch.Tensor], device: torch.device) -> bool:
    """Whether the fused kernels on CUDA `device` address these tensors where they lie:
    the kernels are there, and every host tensor is pinned memory the GPU maps
    (nereus.backends.triton.mapped; NEREUS_MAPPED_HOST=0 says no)."""
    if _KERNELS is None or torch.device(device).type != "cuda":
        return False
    from nereus.backends.triton.mapped import mapped

    return mapped(tensors, device)


def _cross_in_place(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """dst <- src between host and device memory by the fused kernels, queued, when one
    side is contiguous (the other is unpacked into / packed from it) and the GPU maps the
    host side; False (nothing done) otherwise."""
    from nereus.backends.triton.mapped import hold

    device = dst.device if dst.is_cuda else src.device
    if dst.numel() == 0 or not host_in_place([dst, src], device):
        return False
    if src.is_contiguous():
        _KERNELS.unpack_from(src.reshape(-1).view(torch.uint8), [dst], [0])
    elif dst.is_contiguous():
        _KERNELS.pack_into([src], [0], dst.numel() * dst.element_size(), dst.reshape(-1).view(torch.uint8))
    else:
        return False
    hold([dst, src], device)
    return True


_WIDE = (torch.int64, torch.int32)


def widened(dst: torch.Tensor, src: torch.Tensor) -> tuple:
    """(dst, src) viewed as the widest of int64 / int32 that both can be viewed as, else
    as they are. Why: a strided copy runs an indexing kernel per element; on an H200 a
    dim-1 slice of 8B-shaped bf16 weights copies at 0.82 TB/s as bf16 and 1.66 TB/s as
    int64 (rows of contiguous elements, a quarter of the elements to index). The bytes
    moved are the same: the pair must have one dtype, contiguous rows and every byte
    stride, row length and start a multiple of the wider type's size."""
    if dst.dtype != src.dtype or dst.dim() == 0 or dst.stride(-1) != 1 or src.stride(-1) != 1:
        return dst, src
    size = dst.element_size()
    for wide in _WIDE:
        step = wide.itemsize
        if step > size and _rows_of(dst, size, step) and _rows_of(src, size, step):
            try:
                return dst.view(wide), src.view(wide)
            except RuntimeError:  # a layout torch refuses to reinterpret: copy as it is
                break
    return dst, src


def _rows_of(t: torch.Tensor, size: int, step: int) -> bool:
    """Whether `t` (rows contiguous, elements of `size` bytes) views as elements of `step` bytes."""
    return (t.shape[-1] * size) % step == 0 and (t.storage_offset() * size) % step == 0 and \
        all((stride * size) % step == 0 for stride in t.stride()[:-1])


def _regions(buffer: torch.Tensor, views: Sequence[torch.Tensor], offsets: Sequence[int]) -> tuple[list, list]:
    """(buffer regions, views), empty views left out: each view's region of `buffer` as a
    contiguous tensor of its dtype and shape. A region is one `as_strided` of the buffer
    viewed once per dtype; a buffer that cannot be viewed so (length or start not a
    multiple of the element size) gives the region by slicing (`_chunk`)."""
    typed: dict = {}
    regions, pieces = [], []
    for view, offset in zip(views, offsets):
        if view.numel() == 0:
            continue
        dtype = view.dtype
        if dtype not in typed:
            typed[dtype] = _typed(buffer, dtype)
        whole = typed[dtype]
        if whole is None or offset % whole.element_size():
            region = _chunk(buffer, view, offset)
        else:
            region = whole.as_strided(view.shape, _strides(view.shape),
                                      whole.storage_offset() + offset // whole.element_size())
        regions.append(region)
        pieces.append(view)
    return regions, pieces


def _typed(buffer: torch.Tensor, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """The uint8 buffer viewed as `dtype` (its whole elements), or None when its start is
    not a multiple of the element size."""
    size = dtype.itemsize
    flat = buffer.reshape(-1)
    if flat.storage_offset() % size:
        return None
    return flat[:flat.numel() - flat.numel() % size].view(dtype)


_STRIDES: dict = {}


def _strides(shape: torch.Size) -> tuple:
    """Row-major strides of `shape` (cached: a transition's pieces share few shapes)."""
    strides = _STRIDES.get(shape)
    if strides is None:
        out, step = [], 1
        for d in reversed(shape):
            out.append(step)
            step *= d
        strides = _STRIDES[shape] = tuple(reversed(out))
    return strides


def _kernels():
    try:
        module = importlib.import_module("nereus.backends.triton")
    except Exception:  # no triton, or the package is not there yet
        return None
    if hasattr(module, "pack_into") and hasattr(module, "unpack_from"):
        return module
    return None


_KERNELS = _kernels()
BACKEND = "triton" if _KERNELS is not None else "torch"  # the best available; see backend_for


def backend_for(device: torch.device) -> str:
    """The pack/unpack path that runs for tensors on `device`: the Triton kernels only for
    CUDA tensors when they are available, the torch `copy_` path otherwise (CPU, gloo)."""
    return "triton" if _KERNELS is not None and torch.device(device).type == "cuda" else "torch"


if _KERNELS is not None and "NEREUS_PACK_JIT" not in os.environ:
    # a transition never waits for Triton's compiler: variants not compiled yet (by
    # Runtime.prepare or an earlier call) take the torch path while they compile aside
    _KERNELS.default_packer().jit = "prepared"


def kernels():
    """The Triton kernels package, or None where the torch fallback runs."""
    return _KERNELS


def pack(views: Sequence[torch.Tensor], offsets: Sequence[int], nbytes: int,
         out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Input: strided views (the pieces), their byte offsets and the total size.
    Output: a contiguous uint8 buffer with each piece at its offset, row-major."""
    if _KERNELS is not None and views and views[0].is_cuda:
        # a kernel variant not compiled yet (a program's first execution): this module's
        # grouped torch path (one `_foreach_copy_` per dtype), not one `copy_` per piece
        return _KERNELS.pack_into(views, offsets, nbytes, out, fallback_pack=torch_pack)
    return torch_pack(views, offsets, nbytes, out)


def unpack(buffer: torch.Tensor, views: Sequence[torch.Tensor], offsets: Sequence[int]) -> None:
    """Inverse of `pack`: writes each piece of `buffer` into its destination view."""
    if _KERNELS is not None and views and views[0].is_cuda:
        _KERNELS.unpack_from(buffer, views, offsets, fallback_unpack=torch_unpack)
        return
    torch_unpack(buffer, views, offsets)


def checksum(view: torch.Tensor) -> tuple[int, int]:
    """Two order-sensitive integer sums of a view's bytes (verify mode only)."""
    data = view.contiguous().reshape(-1).view(torch.uint8).to(torch.int64)
    weights = torch.arange(data.numel(), dtype=torch.int64, device=data.device) % 65521 + 1
    return int(data.sum()), int((data * weights).sum())

"""Packer: picks the pack/unpack implementation once and caches per-round plans.

Backend: `backend` argument, else the environment variable NEREUS_PACK_BACKEND, else
"auto". "auto" runs the Triton kernels on CUDA tensors when triton imports, and the
torch fallback otherwise; "triton" forces the kernels (on CPU only under
TRITON_INTERPRET=1); "torch" forces the fallback. Each distinct choice is logged once
per process on the logger `nereus.pack`.

Plans: building the tables of a message costs host time (Python per segment, then one
host-to-device copy). Calls that pass `key=` (anything hashable naming the program,
round and peer set, e.g. `("S1->S2", round, "send")`) keep the plan of that key, so a
repeated transition (per-step weight sync) launches at once, with no per-segment host
work at all. A key must keep naming the same segments (same storage, same boxes): on a
hit the cache checks only the segment counts and the buffers' alignment, and the plan
keeps the view addresses of its first call. Calls without a key (the executor's
`pack_into`/`unpack_from`) are cached too, under a fingerprint of every view's shape,
stride, dtype and address mod 16, and of the layout: far cheaper than a rebuild (a Python
tuple per segment instead of the tables: ~0.9 ms per 128 MiB chunk of 42 expert pieces on
the CPU box, 0.14 s for the 8B loopback). Neither buffers nor the tensors of a pack or
unpack are part of its tables: their base addresses go to the kernel in two small
tables, re-uploaded only when they change, so a transition whose new shards sit at new
addresses (a training step ran in between) reuses the plans of the last one. Copy plans
hold both sides' addresses and are fingerprinted by them. The cache holds at
most `cache_size` plans and `cache_bytes` of device tables, least recently used first
out. Torch-fallback plans hold their views (and so their tensors), so they are cached
only under an explicit key.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Hashable, Optional, Sequence

import torch

from . import fallback
from .mapped import mapped
from .segments import ALIGN, as_view, copy_pieces, layout, view_pieces
from .tables import build_launches, launch_classes, upload
from .variants import VariantCompiler, _kernels, _Turns  # noqa: F401 - _Turns: tests import it from here

log = logging.getLogger("nereus.pack")
BACKENDS = ("auto", "triton", "torch")
MESSAGE_ALIGN = 256  # bytes between messages of one pack_many allocation
_LOGGED: set[tuple[str, str]] = set()


def _log_once(backend: str, reason: str) -> None:
    if (backend, reason) not in _LOGGED:
        _LOGGED.add((backend, reason))
        log.info("pack/unpack backend: %s (%s)", backend, reason)


@dataclass(eq=False)
class _Plan:
    """What one call needs, bound to its tensors: fallback entries or device launches."""

    backend: str
    kind: str  # "pack", "unpack" or "copy"
    device: torch.device
    counts: tuple[int, ...] = ()  # segments per message, the cache's identity check
    totals: tuple[int, ...] = ()  # bytes per message
    entries: list = field(default_factory=list)  # torch: (msg, view, offset) or (src, dst)
    launches: list = field(default_factory=list)  # triton: Launch with device tables
    residues: tuple[int, ...] = ()  # buffer address % ALIGN the tables were built for
    bases: Optional[tuple[tuple[int, ...], torch.Tensor]] = None
    view_bases: Optional[tuple[tuple[int, ...], torch.Tensor]] = None  # pack, unpack: per view slot
    # (kind, word, vec, ROWS, COLS) of the launches a Triton plan would make that are not
    # compiled yet under jit "prepared": the plan is not built (no launches) nor cached,
    # and its call takes the torch path
    pending: frozenset = frozenset()

    @property
    def table_bytes(self) -> int:
        return sum(x.segments.numel() * 8 + x.tiles.numel() * 4 for x in self.launches)



class Packer(VariantCompiler):
    """Packs segments into byte buffers and back, with one backend chosen up front.

    `tile=(ROWS, COLS)` forces the kernels' tile shape (tests use it to keep the
    interpreter's program count low); `max_vec=1` disables 16-byte vector hints."""

    def __init__(self, backend: Optional[str] = None, *, tile: Optional[tuple[int, int]] = None,
                 max_vec: int = 2, cache_size: int = 1024, cache_bytes: int = 256 << 20):
        chosen = backend or os.environ.get("NEREUS_PACK_BACKEND") or "auto"
        if chosen not in BACKENDS:
            raise ValueError(f"pack backend {chosen!r}: choose one of {', '.join(BACKENDS)}")
        self.requested = chosen
        self.tile = tile
        self.max_vec = max_vec
        self.cache_size = cache_size
        self.cache_bytes = cache_bytes
        self._cached_bytes = 0
        self._plans: OrderedDict[Hashable, _Plan] = OrderedDict()
        self.plans_built = 0
        # "eager": a kernel variant compiles on its first use (Triton's JIT: about a second
        # each, in the caller's critical path); "prepared": the executor's calls run only
        # compiled variants (`warm`) and take the torch path otherwise while a background
        # thread compiles the missing ones for the next call. NEREUS_PACK_JIT.
        self.jit = os.environ.get("NEREUS_PACK_JIT", "eager")
        self.compiled: set = set()  # (kind, word, vec, ROWS, COLS) known compiled
        self._missing: set = set()
        self._compiling = None
        # one variant compiles at a time, in the order asked for: the background compile and
        # the runtime's lowering-ahead thread would otherwise compile the same variant side
        # by side, and with a plain lock a thread compiling a batch could take it again
        # before a waiting thread wakes (a transition would then wait for the whole batch)
        self._compile_turns = _Turns()
        self._missing_device = None
        self.fallback_calls = 0
        # ((kind, word, vec, ROWS, COLS), seconds) per compile, in order (one per variant)
        self.compile_log: list = []

    # -- backend choice ------------------------------------------------------------
    def backend_for(self, device: torch.device) -> str:
        """Input: the data's device. Output: "triton" or "torch" (logged once)."""
        if self.requested == "torch":
            _log_once("torch", "requested")
            return "torch"
        if self.requested == "triton":
            if _kernels() is None:
                raise ImportError("pack backend 'triton' requested but triton does not import; "
                                  "install triton or set NEREUS_PACK_BACKEND=torch")
            if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
                raise ValueError(f"pack backend 'triton' on {device.type} tensors needs TRITON_INTERPRET=1 "
                                 "set before nereus.backends.triton.kernels is imported")
            _log_once("triton", f"requested, {device.type} tensors")
            return "triton"
        if device.type != "cuda":
            _log_once("torch", f"auto: {device.type} tensors")
            return "torch"
        if _kernels() is None:
            _log_once("torch", "auto: triton does not import")
            return "torch"
        _log_once("triton", "auto: CUDA tensors and triton imports")
        return "triton"

    def clear_cache(self) -> None:
        self._plans.clear()
        self._cached_bytes = 0

    def launch_summary(self, kind: str, key: Hashable) -> str:
        """The cached plan of (`kind`, `key`) in words: per launch its word size, vector
        width, tile ROWSxCOLS and tile count (e.g. "w8v2:16x256:506756t"); "" if none."""
        plan = self._plans.get((kind, key))
        if plan is None:
            return ""
        return " ".join(f"w{x.word}v{x.vec}:{x.rows}x{x.cols}:{x.tiles.shape[0]}t" for x in plan.launches)

    # -- public operations ---------------------------------------------------------
    def pack(self, segments: Sequence[Any], out: Optional[torch.Tensor] = None, *,
             key: Optional[Hashable] = None) -> torch.Tensor:
        """Input: segments of one message. Output: a 1-D uint8 buffer (`out` when given)
        holding each segment row-major at its `layout` offset."""
        residues = (_residue(out),) if out is not None else (0,)
        plan, views = self._plan("pack", key, (len(segments),), residues, lambda: _describe([segments]))
        buffer = out if out is not None else torch.empty(plan.totals[0], dtype=torch.uint8, device=plan.device)
        self._execute(plan, [_bytes(buffer, plan.totals[0])], views)
        return buffer

    def unpack(self, buffer: torch.Tensor, segments: Sequence[Any], *, key: Optional[Hashable] = None) -> None:
        """Inverse of `pack`: writes the buffer's bytes into the segments."""
        plan, views = self._plan("unpack", key, (len(segments),), (_residue(buffer),), lambda: _describe([segments]))
        self._execute(plan, [_bytes(buffer, plan.totals[0])], views)

    def pack_many(self, messages: Sequence[Sequence[Any]], *, key: Optional[Hashable] = None) -> list[torch.Tensor]:
        """Input: several messages (e.g. one per peer of a round). Output: one buffer per
        message, views of one allocation, packed by one launch per access class."""
        counts = tuple(len(m) for m in messages)
        plan, views = self._plan("pack", key, counts, (0,) * len(messages), lambda: _describe(messages))
        starts, at = [], 0
        for total in plan.totals:
            starts.append(at)
            at += -(-total // MESSAGE_ALIGN) * MESSAGE_ALIGN
        whole = torch.empty(at, dtype=torch.uint8, device=plan.device)
        buffers = [whole[s: s + total] for s, total in zip(starts, plan.totals)]
        self._execute(plan, buffers, views)
        return buffers

    def unpack_many(self, buffers: Sequence[torch.Tensor], messages: Sequence[Sequence[Any]], *,
                    key: Optional[Hashable] = None) -> None:
        """Inverse of `pack_many`: buffer i is unpacked into message i's segments."""
        counts = tuple(len(m) for m in messages)
        residues = tuple(_residue(b) for b in buffers)
        plan, views = self._plan("unpack", key, counts, residues, lambda: _describe(messages))
        self._execute(plan, [_bytes(b, total) for b, total in zip(buffers, plan.totals)], views)

    def copy(self, pairs: Sequence[tuple[Any, Any]], *, key: Optional[Hashable] = None) -> None:
        """Local copies (same device): each destination box becomes its source box, all
        pairs in one launch per access class. No buffer in between."""
        plan, _ = self._plan("copy", key, (len(pairs),), (), lambda: _describe_copy(pairs))
        self._execute(plan, [])

    def pack_into(self, views: Sequence[torch.Tensor], offsets: Sequence[int], nbytes: int,
                  out: Optional[torch.Tensor] = None, *, key: Optional[Hashable] = None,
                  fallback_pack=None) -> torch.Tensor:
        """The executor's contract (`nereus.runtime.packing`): pack views at the given
        byte offsets into a uint8 buffer of `nbytes` (`out` when given). Where the kernels
        may not run yet (prepared JIT), `fallback_pack(views, offsets, nbytes, out)` does
        it (the caller's own torch path; default: one `copy_` per view)."""
        residues = (_residue(out),) if out is not None else (0,)
        plan, described = self._plan("pack", key, (len(views),), residues,
                                     lambda: _describe([views], [offsets], [nbytes], [out] if out is not None else ()),
                                     lazy=True)
        buffer = out if out is not None else torch.empty(nbytes, dtype=torch.uint8, device=plan.device)
        if not self._ready(plan):
            (fallback_pack or _pack_each)(views, offsets, nbytes, _bytes(buffer, nbytes))
            return buffer
        self._execute(plan, [_bytes(buffer, nbytes)], described or [views])
        return buffer

    def unpack_from(self, buffer: torch.Tensor, views: Sequence[torch.Tensor], offsets: Sequence[int], *,
                    key: Optional[Hashable] = None, fallback_unpack=None) -> None:
        """The executor's contract: write the bytes at each offset into its view (where the
        kernels may not run yet, by `fallback_unpack(buffer, views, offsets)` if given)."""
        size = _bytes(buffer, 0).numel()
        plan, described = self._plan("unpack", key, (len(views),), (_residue(buffer),),
                                     lambda: _describe([views], [offsets], [size], [buffer]), lazy=True)
        if not self._ready(plan):
            (fallback_unpack or _unpack_each)(_bytes(buffer, size), views, offsets)
            return
        self._execute(plan, [_bytes(buffer, size)], described or [views])

    def _ready(self, plan: _Plan) -> bool:
        """jit="prepared": whether every variant of a Triton plan is compiled; if not,
        the missing ones are compiled in a background thread (one at a time)."""
        if self.jit != "prepared" or plan.backend != "triton":
            return True
        if plan.pending:  # not built: the torch path even if a compile finished meanwhile
            self.ready(plan.pending, plan.device)
            return False
        return self.ready({(plan.kind, x.word, x.vec, x.rows, x.cols) for x in plan.launches}, plan.device)

    # -- plans ---------------------------------------------------------------------
    def _plan(self, kind: str, key: Optional[Hashable], counts: tuple[int, ...], residues: tuple[int, ...],
              describe, lazy: bool = False) -> tuple[_Plan, Optional[list]]:
        """(plan, the call's views per message, or None for a hit under a key: the plan's
        first views stand): the cached plan of `key` when its segment counts and buffer
        residues match, else a new one from `describe()` (views, offsets, totals, device),
        cached. `lazy` (callers that check `_ready`): under jit "prepared", a new plan
        whose kernel variants are not all compiled is only described (`pending`)."""
        described, auto = None, key is None
        if auto:  # identify the call by its shapes, strides and residues (copies: addresses)
            described = describe()
            key = ("auto", described[3], _fingerprint(kind, *described[:3]))
        plan = self._plans.get((kind, key))
        if plan is not None and plan.counts == counts and plan.residues == residues:
            self._plans.move_to_end((kind, key))
            return plan, described[0] if described else None
        views, offsets, totals, device = described or describe()
        plan = self._build(kind, views, offsets, residues, device, lazy and self.jit == "prepared")
        plan.counts, plan.totals = counts, totals
        if plan.pending:
            return plan, views
        if plan.backend == "triton" or not auto:  # torch plans hold views: only when asked
            self._plans[(kind, key)] = plan
            self._cached_bytes += plan.table_bytes
            while len(self._plans) > self.cache_size or self._cached_bytes > self.cache_bytes:
                self._cached_bytes -= self._plans.popitem(last=False)[1].table_bytes
        return plan, views

    def _build(self, kind: str, views: list[list[torch.Tensor]], offsets: list[Sequence[int]],
               residues: tuple[int, ...], device: torch.device, lazy: bool = False) -> _Plan:
        self.plans_built += 1
        backend = self.backend_for(device) if any(views) else "torch"  # nothing to move
        plan = _Plan(backend, kind, device, residues=residues)
        if kind == "copy":
            pairs = list(zip(views[0][0::2], views[0][1::2]))
            if backend == "torch":
                plan.entries = pairs
            else:
                pieces = [p for src, dst in pairs for p in copy_pieces(src, dst)]
                plan.launches = self._launches(pieces, None, device)
            return plan
        entries = [(m, v, o) for m, (msg, offs) in enumerate(zip(views, offsets)) for v, o in zip(msg, offs)]
        if backend == "torch":
            plan.entries = entries
            return plan
        # the tensor side relative to each view's base (slot = its index in `entries`)
        pieces = [p for slot, (m, v, o) in enumerate(entries) for p in view_pieces(v, o + residues[m], m, kind, slot)]
        if lazy:
            classes = frozenset((kind,) + c for c in launch_classes(pieces, self.tile, self.max_vec))
            if not classes <= self.compiled:
                plan.pending = classes
                return plan
        plan.launches = self._launches(pieces, "dst" if kind == "pack" else "src", device)
        return plan

    def _launches(self, pieces: list, rel: Optional[str], device: torch.device) -> list:
        # pack and unpack tables hold no address (both sides relative): anchor 0
        anchor = _kernels().anchor(device).data_ptr() if rel is None else 0
        return [x.to(device) for x in build_launches(pieces, anchor, rel, self.tile, self.max_vec)]

    def _execute(self, plan: _Plan, buffers: list[torch.Tensor], views: Optional[list] = None) -> None:
        if plan.backend == "torch":
            if plan.kind == "copy":
                fallback.copy_pairs(plan.entries)
            elif plan.kind == "pack":
                fallback.pack_entries(buffers, plan.entries)
            else:
                fallback.unpack_entries(buffers, plan.entries)
            return
        kernels = _kernels()
        bases = view_bases = None
        rel = kernels.REL_NONE
        if plan.kind != "copy":
            rel = kernels.REL_DST if plan.kind == "pack" else kernels.REL_SRC
            if any(b.device != plan.device for b in buffers) and not mapped(buffers, plan.device):
                raise ValueError(f"buffers on {sorted({str(b.device) for b in buffers})}, segments on {plan.device}")
            anchor = kernels.anchor(plan.device).data_ptr()
            plan.bases = _table(plan.bases, tuple(b.data_ptr() - r - anchor for b, r in zip(buffers, plan.residues)),
                                plan.device)
            if views is not None:  # else a keyed hit: the views of the plan's first call
                plan.view_bases = _table(plan.view_bases, tuple(p - p % ALIGN - anchor for p in
                                                                (v.data_ptr() for msg in views for v in msg)),
                                         plan.device)
            bases, view_bases = plan.bases[1], plan.view_bases[1]
        for launch in plan.launches:
            kernels.run_launch(launch, rel, bases, view_bases)
        self.compiled |= {(plan.kind, x.word, x.vec, x.rows, x.cols) for x in plan.launches}


def _pack_each(views: Sequence[torch.Tensor], offsets: Sequence[int], nbytes: int, out: torch.Tensor) -> None:
    """The default torch path of `pack_into`: one `copy_` per view."""
    fallback.pack_entries([out], [(0, v, o) for v, o in zip(views, offsets)])


def _unpack_each(buffer: torch.Tensor, views: Sequence[torch.Tensor], offsets: Sequence[int]) -> None:
    """The default torch path of `unpack_from`: one `copy_` per view."""
    fallback.unpack_entries([buffer], [(0, v, o) for v, o in zip(views, offsets)])


def _describe(messages: Sequence[Sequence[Any]], offsets: Optional[Sequence[Sequence[int]]] = None,
              totals: Optional[Sequence[int]] = None, buffers: Sequence[torch.Tensor] = ()):
    """(views, offsets, totals, device) of messages; `layout` decides offsets unless given.
    The device is the one of the views and `buffers`, or of those on a GPU where the
    others are host memory the GPU maps (`mapped.py`)."""
    views = [[as_view(s) for s in msg] for msg in messages]
    if offsets is None:
        layouts = [layout(v) for v in views]
        offsets, totals = [o for o, _ in layouts], [t for _, t in layouts]
    for msg, offs, total in zip(views, offsets, totals):
        _check_fits(msg, offs, total)
    return views, [tuple(o) for o in offsets], tuple(totals), _device([v for m in views for v in m], buffers)


def _describe_copy(pairs: Sequence[tuple[Any, Any]]):
    flat = []
    for src, dst in pairs:
        src, dst = as_view(src), as_view(dst)
        if src.dtype != dst.dtype or src.shape != dst.shape:
            raise ValueError(f"copy between {src.dtype}{list(src.shape)} and {dst.dtype}{list(dst.shape)}")
        flat += [src, dst]
    return [flat], [()], (), _device(flat)


def _fingerprint(kind: str, views: list[list[torch.Tensor]], offsets: list[tuple[int, ...]],
                 totals: tuple[int, ...]) -> tuple:
    """What a Triton plan depends on: every view's shape, stride, dtype and address mod
    ALIGN (a copy's: its address), and the layout. Equal fingerprints give equal plans,
    whatever tensors sit there now."""
    mod = 1 << 64 if kind == "copy" else ALIGN
    return (tuple(tuple((v.data_ptr() % mod, v.shape, v.stride(), v.dtype) for v in msg) for msg in views),
            tuple(offsets), totals)


def _table(cached: Optional[tuple], values: tuple[int, ...], device: torch.device) -> tuple:
    """(values, their int64 table on `device`): `cached` itself while the values are the
    same (no upload), else a new upload."""
    if cached is not None and cached[0] == values:
        return cached
    return values, upload(torch.tensor(values, dtype=torch.int64), device)


def _residue(buffer: torch.Tensor) -> int:
    return buffer.data_ptr() % ALIGN


def _bytes(buffer: torch.Tensor, needed: int) -> torch.Tensor:
    """`buffer` as 1-D uint8, checked to hold at least `needed` bytes."""
    if not buffer.is_contiguous():
        raise ValueError("pack buffers must be contiguous")
    flat = buffer.reshape(-1).view(torch.uint8)
    if flat.numel() < needed:
        raise ValueError(f"a buffer of {flat.numel()} bytes for a message of {needed}")
    return flat


def _check_fits(views: Sequence[torch.Tensor], offsets: Sequence[int], size: int) -> None:
    if len(views) != len(offsets):
        raise ValueError(f"{len(views)} views but {len(offsets)} offsets")
    for view, offset in zip(views, offsets):
        end = offset + view.numel() * view.element_size()
        if offset < 0 or end > size:
            raise ValueError(f"segment [{offset}, {end}) does not fit a buffer of {size} bytes")


def _device(views: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor] = ()) -> torch.device:
    """The device the kernels of a call run on: the one all its tensors share, or the
    one GPU among them where every other tensor is host memory it maps (pinned)."""
    tensors = list(views) + list(buffers)
    devices = {t.device for t in tensors}
    if not devices:
        return torch.device("cpu")
    gpus = {d for d in devices if d.type == "cuda"}
    if len(devices) > 1 and len(gpus) == 1 and mapped(tensors, next(iter(gpus))):
        return gpus.pop()
    if len(devices) != 1:
        raise ValueError(f"segments and buffers of one call must share a device, got {sorted(map(str, devices))}")
    return devices.pop()

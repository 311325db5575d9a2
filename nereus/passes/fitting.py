"""fitting: how much of a transfer fits in a round's room (the resources pass's per-round cuts).

Input: a `TransitionDag`'s transfer and the bytes of room its GPUs have left this round.
Output: a head that fits (whole leading slots, or the pieces and rows of one slot) and the
tail that waits for a later round. Invariant: head and tail together carry exactly the
transfer's elements (`Xfer.volumes` sums its pieces), each piece a valid box of its tensor.
"""

from __future__ import annotations

from .dag import SEND, Piece, TransitionDag, Xfer
from .memory_model import packed
from .layout import box_volume as _volume
from .layout import slot_specs

_KIND_INDEX = {"first": 0, "layer": 1, "last": 2}


def xfer_slice(dag: TransitionDag, x: Xfer, lo: int, hi: int) -> Xfer:
    """`x` restricted to slots [lo, hi), bytes recomputed."""
    info = dag.stages[x.stage]
    last = info.model.layers + 1
    first_v, layer_v, last_v = x.volumes
    elements = (first_v if lo <= 0 < hi else 0) + layer_v * max(0, min(hi, last) - max(lo, 1)) + \
        (last_v if lo <= last < hi else 0)
    return Xfer(x.kind, x.stage, x.alloc, x.free, x.src_gpu, x.dst_gpu, (lo, hi), x.pieces,
                elements * info.xfer_element_bytes(x.states), x.volumes, x.states)


def _pending(dag: TransitionDag, x: Xfer, spec_kinds: list) -> tuple[Xfer, int, int]:
    """(x, whole_slot, row): the least budget with which `_fit` cuts a head of whole slots
    (the first slot's bytes) and with which `_split_slot` cuts one below a slot (one row of
    the first slot's first piece; a very large number when it has none). Below them a
    transfer cannot move in this round, whatever the cut."""
    if x.kind != SEND:
        return x, 0, 0
    element_bytes = dag.stages[x.stage].xfer_element_bytes(x.states)
    kind = _slot_kind(dag, x)
    whole_slot = x.volumes[_KIND_INDEX[kind]] * element_bytes
    kinds = spec_kinds[x.stage]
    first = next((p for p in x.pieces if kinds[p.spec] == kind), None)
    if first is None:
        return x, whole_slot, 1 << 62
    volume = _volume(first.box)
    (r0, r1) = first.box[0]
    row = volume // (r1 - r0) if r1 > r0 else 0
    return x, whole_slot, (row or volume) * element_bytes


def _fit(dag: TransitionDag, x: Xfer, budget: int, fine: bool = False, padding: tuple = (0, 0, 0)) -> tuple:
    """Split send `x` into (head, tail): the longest leading slot range whose bytes fit in
    `budget` (head None when not even one slot fits; tail None when nothing is left).
    `padding`: bytes one slot of each kind (first, layer, last) adds in the packed layout
    (the cuda memory model counts them; memory_model.padding_per_kind)."""
    lo, hi = x.slots
    info = dag.stages[x.stage]
    last = info.model.layers + 1
    element_bytes = info.xfer_element_bytes(x.states)
    first_b, layer_b, last_b = (v * element_bytes + p for v, p in zip(x.volumes, padding))
    room = budget
    end = lo
    if end == 0:
        if first_b > room:
            return _split_slot(dag, x, budget) if fine else (None, x)
        room -= first_b
        end = 1
    layers = max(0, min(hi, last) - end)
    take = layers if layer_b == 0 else min(layers, room // layer_b)
    room -= take * layer_b
    end += take
    if take == layers and end == last and hi > last and last_b <= room:
        end = hi
    if end == lo:
        return _split_slot(dag, x, budget) if fine else (None, x)
    if end >= hi:
        return x, None
    return xfer_slice(dag, x, lo, end), xfer_slice(dag, x, end, hi)


def _spec_kinds(dag: TransitionDag) -> list[tuple[str, ...]]:
    """Per stage of `dag`: the slot kind of every spec index (looked up per piece)."""
    return [tuple(spec.kind for spec in slot_specs(info.model)) for info in dag.stages]


def _slot_kind(dag: TransitionDag, x: Xfer) -> str:
    lo = x.slots[0]
    return "first" if lo == 0 else ("last" if lo == dag.stages[x.stage].model.layers + 1 else "layer")


def _one_slot(x: Xfer, pieces: tuple, elements: int, kind: str, element_bytes: int) -> Xfer:
    """The first slot of `x` carrying only `pieces` (all of the slot's kind, `elements` in all)."""
    volumes = [0, 0, 0]
    volumes[_KIND_INDEX[kind]] = elements
    lo = x.slots[0]
    return Xfer(x.kind, x.stage, x.alloc, x.free, x.src_gpu, x.dst_gpu, (lo, lo + 1), pieces,
                elements * element_bytes, tuple(volumes), x.states)


def _split_slot(dag: TransitionDag, x: Xfer, budget: int, spec_kinds=None, state_bytes: tuple = ()) -> tuple:
    """Less than one slot fits: send the first slot's pieces that fit, cutting the piece
    that straddles the budget along dim 0 (any row range of a box is a valid segment).
    Only the head's pieces are measured: the rest of the slot has x's elements of that
    kind minus the head's (`Xfer.volumes` sums its pieces). `spec_kinds`: `_spec_kinds(dag)`.
    `state_bytes`: the element bytes of each of x's states, to count every segment at its
    packed size (memory_model.packed: the cuda model); empty: raw bytes."""
    lo, hi = x.slots
    info = dag.stages[x.stage]
    kinds = (spec_kinds or _spec_kinds(dag))[x.stage]
    kind = _slot_kind(dag, x)
    element_bytes = info.xfer_element_bytes(x.states)
    pieces = [p for p in x.pieces if kinds[p.spec] == kind]

    def cost(elements: int) -> int:  # the bytes a piece of `elements` takes in the budget
        return sum(packed(elements * size) for size in state_bytes) if state_bytes else elements * element_bytes

    room = budget
    head: list = []
    taken = 0
    for i, piece in enumerate(pieces):
        volume = _volume(piece.box)
        if cost(volume) <= room:
            head.append(piece)
            room -= cost(volume)
            taken += volume
            continue
        (r0, r1), others = piece.box[0], piece.box[1:]
        row = volume // (r1 - r0)
        rows = room // (row * element_bytes) if row else 0
        while rows and cost(rows * row) > room:  # packed sizes: a few rows fewer at most
            rows -= 1
        tail = pieces[i + 1:]
        if rows:
            head.append(Piece(piece.spec, ((r0, r0 + rows),) + others))
            taken += rows * row
            tail = [Piece(piece.spec, ((r0 + rows, r1),) + others)] + tail
        else:
            tail = [piece] + tail
        break
    else:
        tail = []
    if not head:
        return None, x
    rest = xfer_slice(dag, x, lo + 1, hi) if hi > lo + 1 else None
    first = _one_slot(x, tuple(head), taken, kind, element_bytes)
    if not tail:
        return first, rest
    left = _one_slot(x, tuple(tail), x.volumes[_KIND_INDEX[kind]] - taken, kind, element_bytes)
    return first, (left if rest is None else (left, rest))

"""The checks every rank runs on its own part of a program before any byte moves, proven
or not (docs/program.md, "In the runtime"): linear in the part, no rank sees another
rank's part or the whole program. Pure Python, no torch.

    check_writes(program, gpu)        # ProgramError naming the round and op, or None
    pair_digests(rounds)              # ((src, dst, digest), ...): this rank's messages per pair
    balance(digests, gpu)             # this rank's term of the agreement's sum (module doc)
    pair_messages(prog, src, dst)     # the failure path: one pair's messages, described
    disagreement(sender, receiver)    # ... and the first that sender and receiver see apart

`check_writes` (run by `program.rank_program` on every lowering): the keeps, copies and
receives of GPU `gpu` write every element of each of its after-shards exactly once and
nothing else from old shards of the same model-stage, every box on the GPU lies inside
its tensor, no shard is read after its free, and a keep hands a shard over between
units in the same memory (device or host).
It is what the runtime's element count (`wires.check_complete`) cannot see: a send that
writes a fused qkv's k rows twice and its v rows never counts as many elements as a
right one. Exactly-once is checked by a hash: every box B gets H(B) = prod_d (r_d^hi_d
- r_d^lo_d) mod p, which is const x sum over the elements x of B of prod_d r_d^x_d, so
the writes' sum equals the shard boxes' sum exactly when every element is written as
often as the shard holds it (once), but with probability at most (sum of the tensor's
dims) / p when it is not (Schwartz-Zippel: a nonzero polynomial in the r_d, drawn at
random per process; p = 2^61 - 1). One multiplication per dimension per segment, where
checking that n boxes are disjoint would sort them per dimension; a shard that fails is
then explained exactly (which op writes what a second time, or what no op writes).

`pair_digests`: per ordered pair (src, dst) of ranks this rank sends to or receives
from, a digest of every message between them as this rank lowered it (round, tag, and
each piece's tensor, units, global box, elements, bytes, in packing order). The sender
and the receiver compute it each from its own part; `balance` turns this rank's digests
into one number mod 2^64 (its sends' hashes minus its receives'), and the agreement sums
every rank's: the sum is 0 when every pair agrees, and not 0 (but with probability
2^-64) when some sender packs what its receiver does not expect (another box, order,
unit or cut). Only then are the pairs' digests, and one pair's messages, gathered to
name the ranks, the round and the op (nereus.runtime.distribute).
"""

from __future__ import annotations

import functools
import hashlib
import random
from typing import Optional

from nereus.ir.diagnostics import ProgramError
from nereus.ir.ranges import parse_at

from .boxes import Box, as_box, box_numel, intersect

_P = (1 << 61) - 1  # a Mersenne prime: the hash's field
_RANDOM = random.SystemRandom()
_BASES: list = []  # r_d per dimension d, drawn once per process (no rank needs another's)


def _base(d: int) -> int:
    while len(_BASES) <= d:
        _BASES.append(_RANDOM.randrange(2, _P - 1))
    return _BASES[d]


@functools.lru_cache(maxsize=1 << 18)
def _power(d: int, e: int) -> int:
    return pow(_base(d), e, _P)


@functools.lru_cache(maxsize=1 << 16)
def _box_hash(box: tuple, shape: tuple) -> int:
    """const x the sum over the box's elements of prod_d r_d^x_d (module docstring), or -1
    when the box is no list of integer [lo, hi] inside `shape` (0 <= lo < hi <= dim)."""
    if len(box) != len(shape):
        return -1
    h = 1
    for d, (bounds, n) in enumerate(zip(box, shape)):
        if len(bounds) != 2:
            return -1
        lo, hi = bounds
        if type(lo) is not int or type(hi) is not int or not 0 <= lo < hi <= n:
            return -1
        h = h * (_power(d, hi) - _power(d, lo)) % _P
    return h


def _op_name(r: int, k: int, op: dict) -> str:
    kind = op["op"]
    what = f"send {op['src']} -> {op['dst']}" if kind == "send" else kind
    return f"round {r}, op {op.get('index', k)} ({what})"


@functools.lru_cache(maxsize=1 << 14)
def _range_sum(i: int, lo: int, hi: int, step: int) -> int:
    """sum of q_i^m over the members m = lo, lo + step, ... < hi of index i, in closed form."""
    n = max(0, -(-(hi - lo) // step))
    q = _base(64 + i)  # index bases apart from the dimension bases
    first, ratio = pow(q, lo, _P), pow(q, step, _P)
    if ratio == 1:
        return first * n % _P
    return first * (pow(ratio, n, _P) - 1) % _P * pow(ratio - 1, _P - 2, _P) % _P


def _at_hash(raw, indices) -> int:
    """const x sum over a v2 entry's members of prod_i q_i^(member index i): a family's
    members hash like another dimension of its boxes (1 for a plain tensor, no `at`); -1
    when `at` is no list of ranges inside the family's indices."""
    if raw is None:
        return 1 if not indices else -1
    try:
        at = parse_at(raw, "", "'at'")
    except ProgramError:
        return -1
    if len(at) != len(indices):
        return -1
    h = 1
    for i, ((lo, hi, step), (first, end)) in enumerate(zip(at, indices)):
        if not first <= lo < hi <= end:
            return -1
        h = h * _range_sum(i, lo, hi, step) % _P
    return h


def check_writes(program: dict, gpu: int) -> None:
    """Input: a JSON program v1 or v2 (whole or a rank's part; a v2 family's members hash
    as one more dimension of its boxes, so its ranges are checked without being written
    out), and a GPU. Raises ProgramError ("rank G refuses its part of the program S1 ->
    S2: round K, op I (...): ...") unless the keeps, copies and receives on `gpu` tile
    each of its after-shards exactly (module docstring). Linear in the entries on `gpu`."""
    transition = program["transition"]
    prefix = f"rank {gpu} refuses its part of the program {transition['from']} -> {transition['to']}"
    shapes = {t["name"]: tuple(t["shape"]) for t in program["tensors"]}
    indices = {t["name"]: tuple(tuple(r) for r in t.get("indices", ())) for t in program["tensors"]}
    box_hash = _box_hash  # a local: looked up once per box
    memory = {}  # (phase, unit) -> offload flag
    stage = {}  # (phase, unit) -> model-stage
    want = {}  # (after unit, tensor or family) -> H of its shard on `gpu`
    for phase in ("before", "after"):
        for unit in program["units"][phase]:
            memory[(phase, unit["id"])] = bool(unit.get("offload", False))
            stage[(phase, unit["id"])] = unit["model_stage"]
            for shard in unit.get("shards", ()):
                if shard["gpu"] != gpu:
                    continue
                name = shard["tensor"]
                members = _at_hash(shard.get("at"), indices.get(name, ()))
                total = 0
                for raw in shard["boxes"]:
                    try:  # a JSON box as a tuple key (10^4 boxes in a MoE part)
                        h = box_hash(tuple(map(tuple, raw)), shapes[name])
                    except (TypeError, KeyError):
                        h = -1
                    if h < 0 or members < 0:
                        raise ProgramError(f"{prefix}: {phase} unit {unit['id']} holds box {raw} of {name}"
                                           + (f" at {shard.get('at')}" if shard.get("at") is not None else "")
                                           + f", which is no box inside the tensor (shape {list(shapes.get(name, ()))})")
                    total += h
                if phase == "after":
                    key = (unit["id"], name)
                    want[key] = (want.get(key, 0) + total * members) % _P
    got = dict.fromkeys(want, 0)
    pairs: set = set()  # (before unit, after unit, keep) checked by _check_pair
    freed: dict = {}  # before unit -> the round that frees its shards on `gpu`
    for r, rnd in enumerate(program["rounds"]):
        for k, op in enumerate(rnd["ops"]):
            kind = op["op"]
            if kind == "send":
                reads, writes = op["src"] == gpu, op["dst"] == gpu
            elif kind in ("keep", "copy"):
                reads = writes = op["gpu"] == gpu
            else:
                if kind == "free" and op["gpu"] == gpu:
                    freed.setdefault(op["unit"], r)
                continue
            if not writes:  # a send out (or none of this GPU's): rank_program's lowering checks that
                # its boxes lie in the source and the destination shard, the receiver checks the rest
                for seg in op["segments"] if reads and freed else ():
                    _not_freed(prefix, r, k, op, seg, _units(seg, op)[0], freed)
                continue
            keep = kind == "keep"
            for seg in op["segments"]:  # (10^5 segments in a MoE part: the least work per segment)
                name = seg["tensor"]
                try:
                    h = box_hash(tuple(map(tuple, seg["box"])), shapes[name]) * \
                        _at_hash(seg.get("at"), indices.get(name, ()))
                except (TypeError, KeyError):
                    h = -1
                if h < 0:
                    raise ProgramError(f"{prefix}: {_op_name(r, k, op)} moves box {seg['box']} of {name}"
                                       + (f" at {seg.get('at')}" if seg.get("at") is not None else "")
                                       + f", which is no box inside the tensor (shape {list(shapes.get(name, ()))})")
                src_unit, dst_unit = _units(seg, op)
                pair = (src_unit, dst_unit, keep)
                if pair not in pairs:  # once per pair of units (and keep or not)
                    _check_pair(prefix, _op_name(r, k, op), name, pair, stage, memory)
                    pairs.add(pair)
                if freed and reads:  # (a receive reads the sender's shard, not this GPU's)
                    _not_freed(prefix, r, k, op, seg, src_unit, freed)
                try:
                    got[(dst_unit, name)] += h
                except KeyError:
                    raise ProgramError(f"{prefix}: {_op_name(r, k, op)} writes {name} into after unit "
                                       f"{dst_unit}, which holds no shard of it on GPU {gpu}") from None
    for key, expected in want.items():
        if got[key] % _P != expected:
            raise ProgramError(f"{prefix}: {_explain(_written_out(program), gpu, key)}",
                               hint="a wrong program: every element of a new shard must be written exactly once "
                                    "(`nereusc verify` proves the whole program; docs/program.md)")


def _units(seg: dict, op: dict) -> tuple:
    """(src_unit, dst_unit) of a segment: its own, or those its op states once (rank parts)."""
    return (seg["src_unit"] if "src_unit" in seg else op["src_unit"],
            seg["dst_unit"] if "dst_unit" in seg else op["dst_unit"])


def _written_out(program: dict) -> dict:
    """The failure path: the program as v1 with units on every segment (what _explain reads)."""
    from nereus.ir.program import expand_ranges, expand_segment_units

    return expand_segment_units(expand_ranges(program))


def _not_freed(prefix: str, r: int, k: int, op: dict, seg: dict, src_unit: str, freed: dict) -> None:
    """A segment that round r reads from a before unit on this GPU: not after its free."""
    if freed.get(src_unit, r) < r:
        raise ProgramError(f"{prefix}: {_op_name(r, k, op)} reads {seg['tensor']} from before unit "
                           f"{src_unit}, which round {freed[src_unit]} freed")


def _check_pair(prefix: str, where: str, name: str, pair: tuple, stage: dict, memory: dict) -> None:
    """A segment from before unit pair[0] to after unit pair[1] (by a keep: pair[2]) stays
    within one model-stage, and a keep within one memory."""
    src, dst, keep = pair
    if stage.get(("before", src)) != stage.get(("after", dst)):
        raise ProgramError(f"{prefix}: {where} moves {name} from {src} to {dst}, which are not units of one "
                           "model-stage", hint="a model-stage's new shards come from its own old shards only")
    if keep and memory.get(("before", src)) != memory.get(("after", dst)):
        raise ProgramError(f"{prefix}: {where} hands {name} over from {src} to {dst}, which live in different "
                           "memory (offload)",
                           hint="a keep aliases the tensor: only between units both on the device or both in host "
                                "memory")


def _text(box: Box) -> str:
    return str([list(b) for b in box])


def _explain(program: dict, gpu: int, key: tuple) -> str:
    """Why the writes of after-shard `key` on `gpu` do not tile it (the failure path:
    quadratic in that shard's writes)."""
    unit, name = key
    shard = []
    for u in program["units"]["after"]:
        if u["id"] == unit:
            shard = [as_box(b) for s in u.get("shards", ()) if s["gpu"] == gpu and s["tensor"] == name
                     for b in s["boxes"]]
    where = f"after unit {unit}'s shard of {name} on GPU {gpu}"
    for i, a in enumerate(shard):
        for b in shard[:i]:
            if intersect(a, b) is not None:
                return f"{where} lists overlapping boxes {_text(b)} and {_text(a)}"
    writes = []  # (op name, box)
    for r, rnd in enumerate(program["rounds"]):
        for k, op in enumerate(rnd["ops"]):
            target = op.get("dst") if op["op"] == "send" else op.get("gpu") if op["op"] in ("keep", "copy") else None
            if target != gpu:
                continue
            for seg in op["segments"]:
                if (seg["dst_unit"], seg["tensor"]) == key:
                    box = as_box(seg["box"])
                    for earlier, other in writes:
                        if intersect(box, other) is not None:
                            return (f"{_op_name(r, k, op)} writes {_text(box)} of {name} into {where}, but "
                                    f"{earlier} wrote {_text(other)} there already: elements written twice")
                    inside = sum(box_numel(p) for p in (intersect(box, s) for s in shard) if p is not None)
                    if inside != box_numel(box):
                        return f"{_op_name(r, k, op)} writes {_text(box)} of {name} outside {where}"
                    writes.append((_op_name(r, k, op), box))
    for box in shard:
        covered = sum(box_numel(p) for p in (intersect(box, w) for _, w in writes) if p is not None)
        if covered != box_numel(box):
            return (f"no op writes {box_numel(box) - covered} of the {box_numel(box)} elements of box {_text(box)} "
                    f"of {where}")
    return f"the writes into {where} do not tile it"


# -- messages: what a sender packs is what its receiver expects ---------------------------


def _pieces_text(pieces) -> str:
    """A message's pieces as the digest reads them: packing order, units, global box,
    elements, bytes, and how they travel (direct, parts)."""
    return "\n".join([f"{_names_text(p.tensors)} {p.src_unit} {p.dst_unit} {_box_text(p.box)} {p.numel} {p.nbytes} "
                      f"{p.direct:d} {p.parts}" for p in pieces])


_names_text = functools.lru_cache(maxsize=1 << 14)(",".join)  # a v2 piece's tensors: one string per range


_box_text = functools.lru_cache(maxsize=1 << 16)(repr)  # a few hundred distinct boxes per part


def message_digest(msg) -> str:
    return hashlib.sha256(f"{msg.nbytes}\n{_pieces_text(msg.pieces)}".encode()).hexdigest()[:32]


def pair_digests(rounds, gpu: int) -> tuple:
    """((src, dst, digest), ...) sorted: per pair of ranks this rank exchanges messages with
    (it is src or dst), a digest of those messages in (round, tag) order as this rank
    lowered them (program.RoundWork lists)."""
    per_pair: dict = {}
    for work in rounds:
        for msgs, outgoing in ((work.sends, True), (work.recvs, False)):
            for msg in msgs:
                pair = (gpu, msg.peer) if outgoing else (msg.peer, gpu)
                per_pair.setdefault(pair, []).append(f"{work.index}:{msg.op_index}:{message_digest(msg)}")
    return tuple(sorted((src, dst, hashlib.sha256(";".join(sorted(texts, key=_order)).encode()).hexdigest()[:32])
                        for (src, dst), texts in per_pair.items()))


def _order(text: str) -> tuple:
    r, tag, _ = text.split(":", 2)
    return int(r), int(tag)


def balance(digests: tuple, gpu: int) -> int:
    """This rank's term of the agreement's sum mod 2^64: its pairs as sender minus its
    pairs as receiver, each hashed with the pair. Summed over every rank, each pair's
    sender term cancels its receiver term exactly when both hold the same digest."""
    total = 0
    for src, dst, digest in digests:
        h = int.from_bytes(hashlib.sha256(f"{src}>{dst}:{digest}".encode()).digest()[:8], "little")
        total += h if src == gpu else -h
    return total % (1 << 64)


def first_disagreeing_pair(views: list) -> Optional[tuple]:
    """views: every rank's `pair_digests`, in rank order. The first pair (src, dst) whose
    sender and receiver hold different digests (a message one side has and the other
    lacks included), or None."""
    sent, expected = {}, {}
    for rank, digests in enumerate(views):
        for src, dst, digest in digests or ():
            if src == rank:
                sent[(src, dst)] = digest
            if dst == rank:
                expected[(src, dst)] = digest
    for pair in sorted(set(sent) | set(expected)):
        if sent.get(pair) != expected.get(pair):
            return pair
    return None


def pair_messages(prog, src: int, dst: int) -> list:
    """[(round, tag, digest, pieces)] of the messages src -> dst in this rank's work list
    (it is src or dst), pieces as (tensor, box, src unit, dst unit, bytes, direct)."""
    out = []
    for work in prog.rounds:
        msgs = work.sends if prog.gpu == src else work.recvs
        for msg in msgs:
            if msg.peer == (dst if prog.gpu == src else src):
                out.append((work.index, msg.op_index, message_digest(msg),
                            [(",".join(p.tensors), _text(p.box), p.src_unit, p.dst_unit, p.nbytes, p.direct)
                             for p in msg.pieces]))
    return sorted(out, key=lambda m: (m[0], m[1]))


def disagreement(src: int, dst: int, sender: list, receiver: list) -> str:
    """The first message src -> dst that the sender's `pair_messages` and the receiver's
    tell apart, as "round K, op I (send S -> D): why"."""
    sends = {(m[0], m[1]): m for m in sender}
    recvs = {(m[0], m[1]): m for m in receiver}
    for key in sorted(set(sends) | set(recvs)):
        a, b = sends.get(key), recvs.get(key)
        where = f"round {key[0]}, op {key[1]} (send {src} -> {dst})"
        if a is None:
            return f"{where}: rank {dst} expects it, rank {src} never sends it"
        if b is None:
            return f"{where}: rank {src} sends it, rank {dst} never expects it"
        if a[2] == b[2]:
            continue
        if sorted(a[3]) == sorted(b[3]):
            i = next(i for i, (p, q) in enumerate(zip(a[3], b[3])) if p != q)
            return (f"{where}: rank {src} packs its segments in another order than rank {dst} unpacks them "
                    f"(piece {i}: {_piece(a[3][i])} against {_piece(b[3][i])})")
        for i, (p, q) in enumerate(zip(a[3], b[3])):
            if p != q:
                return f"{where}: piece {i} is {_piece(p)} to rank {src} and {_piece(q)} to rank {dst}"
        return f"{where}: rank {src} packs {len(a[3])} pieces, rank {dst} expects {len(b[3])}"
    return f"rank {src} and rank {dst} hold different digests of their messages"


def _piece(p) -> str:
    tensor, box, src_unit, dst_unit, nbytes, direct = p
    return f"{tensor} {box} {src_unit} -> {dst_unit}, {nbytes} bytes{' direct' if direct else ''}"

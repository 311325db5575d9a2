"""verify: JSON program v1 or v2 → VerifyReport, or ProgramError naming the round and op.

Input: a program dict (docs/program.md) and, optionally, the module (plans) it claims to
come from. Output: a `VerifyReport` (rounds, ops, bytes, per-GPU peak memory).
`verify_header` checks and indexes the header (boxes, GPUs, nodes, units); with `against`,
`verify_world` then re-derives from the plans everything the header states about the
world and rejects any difference. A symbolic replay then proves:
  - every box of every after-unit shard is written exactly once (keep, copy or send), from a
    before-unit shard of the same model-stage that holds it (box inside one of its boxes)
    and is not yet freed, into an allocated after shard (box inside one of its boxes); a
    keep hands a whole identical shard (same boxes, same order) over on one GPU, between
    units in the same memory;
  - every segment box has the tensor's rank and integer bounds 0 ≤ lo < hi ≤ dim;
  - ops of a round come in phase order (alloc; keep, copy, send; stage_out, free); a send has
    distinct GPUs (its receive is the same record, so it is matched in the same round);
  - declared bytes equal segment volumes × dtype sizes; alloc bytes equal the after shard
    minus what is kept into it; free and stage_out bytes equal the before shard minus what
    is kept out of it; every after shard allocated once, every before shard freed once;
  - memory on every GPU after each round's allocs and transfers — resident_bytes + before
    shards still on the GPU + allocations + the round's send buffers (what each segment
    costs on its two GPUs under the header's `memory_model`, nereus.passes.memory_model:
    "cuda" its packed bytes on both, also out of host memory, a v2 segment per member;
    "cpu", and a program without the field, its bytes, on the source only when read from
    GPU memory) — stays ≤ capacity_bytes (mem_bytes if absent); host memory per node ≤
    host_mem_bytes.
Invariant: any input — malformed or not — ends in a report or a located ProgramError.

Version 2 (ranges, docs/program.md) is proven as written, never expanded member by
member: a family's shard or segment is one box over the product of its `at` ranges.
Containment is range containment; "written exactly once" keeps, per after shard of a
family and distinct box, the written members as one bitset (a write whose members meet
those of an overlapping box is a double write); the counts then compare volumes × member
counts. So the replay's work grows with the program's entries, not with its members.
"""

from __future__ import annotations

import gc
import json
from collections import defaultdict
from dataclasses import dataclass, replace

from nereus.ir.diagnostics import ProgramError
from nereus.ir.program import expand_segment_units, program_from_json
from nereus.ir.units import human_bytes

from nereus.ir.ranges import at_json, count, member_mask, members

from .memory_model import destination_bytes, source_bytes
from .verify_fields import check_fields
from .verify_header import (BoxError, Header, check_box, entries_volume, fail, holds, is_int, nonnegative, overlap,
                            parse_header, shard_at, shown, volume)

PHASE = {"alloc": 0, "keep": 1, "copy": 1, "send": 1, "stage_out": 2, "free": 2}


@dataclass(frozen=True)
class VerifyReport:
    rounds: int
    ops: int
    segments: int
    bytes_moved: int  # copy + send bytes (the compile summary's "moved" also counts staged bytes)
    peak_bytes: dict  # gpu -> highest memory seen
    worst_gpu: int
    worst_fraction: float  # peak / capacity on the worst GPU
    warnings: tuple = ()  # fields no reader knows (verify_fields.py): ignored, and said so
    memory_model: str = "cpu"  # the device memory model the peaks are proven under (header field)

    def __str__(self) -> str:
        return (f"ok: {self.rounds} rounds, {self.ops} ops, {self.segments} segments, {human_bytes(self.bytes_moved)} copied or sent;"
                f" peak {self.worst_fraction:.1%} of capacity on GPU {self.worst_gpu} ({self.memory_model} memory model)")


def _label(name: str, at: tuple) -> str:
    """A tensor as errors name it: a v2 family with its `at` ranges."""
    return f"{name} at {at_json(at)}" if at else name


class _Cursor:
    """Where the replay is, so that a malformed field deep inside an op is reported there."""

    where = "header"


def verify_program(program_json: dict, against=None, progress=None) -> VerifyReport:
    """Replay `program_json` symbolically (module docstring); raise ProgramError on the
    first violation, naming its round and op index (or the header field). `against`: the
    `Module` holding the transition's plans, to check the header against them.
    `progress`: called ("round", rounds done, rounds) after each round."""
    enabled = gc.isenabled()
    gc.disable()  # many small acyclic tuples: cycle collection only costs time here
    cursor = _Cursor()
    try:
        data = program_from_json(program_json).data
        # every known field of its JSON type first (`true` == 1 and 2.0 == 2 in Python: no
        # later comparison could tell), unknown fields as warnings
        warnings = check_fields(data)
        if "rank" in data:  # docs/program.md, "Rank programs": one rank's part
            raise ProgramError(f"this is rank {data['rank']}'s part of the program; verify proves whole programs",
                               hint="emit the whole program (without --rank) to verify it; the runtime checks each "
                                    "part's digest against the proven whole")
        try:  # the compact form (units named once per op, as rank parts write them): per segment
            data = expand_segment_units(data)
        except (AttributeError, KeyError, TypeError):
            pass  # malformed: the replay names where
        from .verify_codec import is_codec, verify_codec

        if is_codec(data):  # a weight-sync codec program: its dense form, then what the codec adds
            report = verify_codec(data, lambda dense: _prove(dense, against, cursor, progress))
        else:
            report = _prove(data, against, cursor, progress)
        return replace(report, warnings=tuple(warnings))
    except ProgramError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as error:
        # a field of the wrong shape that no explicit check names: still located
        raise ProgramError(f"{cursor.where}: malformed program ({type(error).__name__}: {error})",
                           hint="docs/program.md lists every field and its type") from None
    finally:
        if enabled:
            gc.enable()


def _prove(data: dict, against, cursor: _Cursor, progress=None) -> VerifyReport:
    """The header checks (and, with `against`, the comparison with the plans), then the replay."""
    header = parse_header(data)
    if against is not None:
        from .verify_world import check_against

        check_against(data, against)
    return _replay(data, header, cursor, progress)


def _replay(data: dict, header: Header, cursor: _Cursor, progress=None) -> VerifyReport:
    tensors, before, after = header.tensors, header.before, header.after
    capacity, node_of, host_cap = header.capacity, header.node_of, header.host_capacity
    model = header.memory_model

    def shard_bytes(shards) -> int:
        return sum(entries_volume(entries) * tensors[name][1] for name, entries in shards.items())

    def host_add(where, node, nbytes):
        host[node] += nbytes
        if host[node] > host_cap.get(node, float("inf")):
            fail(f"{where}: host memory of node {node} overflows ({human_bytes(host[node])},"
                 f" {human_bytes(host_cap[node])} available)")

    mem = defaultdict(int)
    for g, b in header.resident.items():
        mem[g] += b
    status = {}
    host = defaultdict(int)
    for uid, per_gpu in before.items():
        for g, shards in per_gpu.items():
            if ("before", uid) in header.offloaded:  # state of an offloaded model-stage waits in host memory
                host_add(f"header field 'units.before' (unit {uid})", node_of[g], shard_bytes(shards))
                status[(uid, g)] = "host"
            else:
                mem[g] += shard_bytes(shards)
                status[(uid, g)] = "gpu"
    rounds = data["rounds"]
    if not isinstance(rounds, list):
        fail("header field 'rounds' must be a list")
    kept_into, kept_out = _kept_bytes(rounds, header, cursor)
    allocated = set()
    # (after unit, GPU, tensor) -> {box: bitset of the members written}, and their elements
    written: dict = defaultdict(dict)
    written_volume: dict = defaultdict(int)
    peak = dict(mem)
    # the state before round 0 fits too (the rounds check after their allocs; a program
    # with no rounds is checked only here)
    _check_memory("before round 0", mem, {}, capacity, peak)
    ops = segments = moved = 0
    seen_ids: set = set()
    for k, rnd in enumerate(rounds):
        cursor.where = f"round {k}"
        if not isinstance(rnd, dict) or not isinstance(rnd.get("ops"), list):
            fail(f"round {k}: a round is an object with a list 'ops'")
        phase = 0
        transient = defaultdict(int)
        keeps = defaultdict(list)
        for i, op in enumerate(rnd["ops"]):
            kind = op.get("op") if isinstance(op, dict) else None
            where = cursor.where = f"round {k}, op {i} ({kind})"
            if not isinstance(kind, str) or kind not in PHASE:
                fail(f"{where}: unknown op", hint="ops are alloc, keep, copy, send, stage_out, free")
            if PHASE[kind] < phase:
                fail(f"{where}: out of phase order", hint="a round runs allocs, then transfers, then frees")
            if PHASE[kind] > 1 and phase <= 1:
                _check_memory(_before_frees(k, i), mem, transient, capacity, peak)
            phase = PHASE[kind]
            ops += 1
            # `id` and `round` (docs/program.md: added fields, so optional): ids unique, the
            # round the op's own
            if "round" in op and (not is_int(op["round"]) or op["round"] != k):
                fail(f"{where}: its 'round' field says {json.dumps(op['round'])}, it sits in round {k}")
            if "id" in op:
                if not is_int(op["id"]) or op["id"] in seen_ids:
                    fail(f"{where}: op id {json.dumps(op['id'])} is not a new integer",
                         hint="op ids are unique, in program order")
                seen_ids.add(op["id"])
            if kind in ("alloc", "free", "stage_out"):
                gpu, unit = op.get("gpu"), op.get("unit")
                if not is_int(gpu) or gpu not in capacity:
                    fail(f"{where}: GPU {gpu!r} is not in header field 'gpus'")
                if not isinstance(unit, str):
                    fail(f"{where}: unit {unit!r} is not a unit id")
                key = (unit, gpu)
                nbytes = nonnegative(op.get("bytes"), where, "bytes")
            if kind == "alloc":
                if unit not in after or gpu not in after[unit]:
                    fail(f"{where}: {unit} holds nothing on GPU {gpu} in the target layout")
                if key in allocated:
                    fail(f"{where}: {unit} allocated twice on GPU {gpu}")
                expected = shard_bytes(after[unit][gpu]) - kept_into[key]
                if nbytes != expected:
                    fail(f"{where}: declares {nbytes} bytes, the shard needs {expected}")
                allocated.add(key)
                if ("after", unit) in header.offloaded:
                    host_add(where, node_of[gpu], nbytes)
                else:
                    mem[gpu] += nbytes
            elif kind in ("free", "stage_out"):
                state = status.get(key)
                if state is None:
                    fail(f"{where}: {unit} holds nothing on GPU {gpu} in the source layout")
                if state == "freed" or (kind == "stage_out" and state == "host"):
                    fail(f"{where}: {unit} on GPU {gpu} already {'in host memory' if state == 'host' else state}")
                expected = shard_bytes(before[unit][gpu]) - kept_out[key]
                if nbytes != expected:
                    fail(f"{where}: declares {nbytes} bytes, the shard has {expected} not kept")
                if kind == "stage_out":
                    mem[gpu] -= nbytes
                    host_add(where, node_of[gpu], nbytes)
                    status[key] = "host"
                else:
                    if state == "host":
                        host[node_of[gpu]] -= nbytes
                    else:
                        mem[gpu] -= nbytes
                    status[key] = "freed"
            else:
                if kind == "send":
                    src, dst = op.get("src"), op.get("dst")
                    if src == dst:
                        fail(f"{where}: a send from GPU {src} to itself", hint="use a copy")
                else:
                    src = dst = op.get("gpu")
                for g in (src, dst):
                    if not is_int(g) or g not in capacity:
                        fail(f"{where}: GPU {g!r} is not in header field 'gpus'")
                if not isinstance(op.get("segments"), list):  # empty is allowed: a 0-byte message
                    fail(f"{where}: needs a list of segments")
                total = on_src = on_dst = 0
                try:
                    for n, s in enumerate(op["segments"]):
                        nbytes, at, box = _transfer(where, s, src, dst, header, status, allocated, written,
                                                    written_volume)
                        total += nbytes
                        if kind == "send":  # a v2 segment stands for count(at) segments of one size
                            members_, each = count(at), nbytes // count(at)
                            on_src += members_ * source_bytes(model, each, status[(s["src_unit"], src)] == "host")
                            on_dst += members_ * destination_bytes(model, each)
                        segments += 1
                        if kind == "keep":
                            offloaded = header.offloaded
                            if (("before", s["src_unit"]) in offloaded) != (("after", s["dst_unit"]) in offloaded):
                                fail(f"{where}: keeps {s['tensor']} between an offloaded and a GPU-resident unit",
                                     hint="a keep hands over in place: both units must live in the same memory")
                            for idx in members(at):  # keeps are small (whole shards on one GPU): per member
                                keeps[(s["src_unit"], s["dst_unit"], src, s["tensor"], idx)].append((box, where))
                except BoxError as error:  # where the box stands in the program
                    error.path = ("rounds", k, "ops", i, "segments", n, "box") + error.path
                    raise
                if kind != "keep":
                    if not is_int(op.get("bytes")):
                        fail(f"{where}: bytes must be a non-negative integer, not {shown(op.get('bytes'))}")
                    if op.get("bytes") != total:
                        fail(f"{where}: declares {op.get('bytes')} bytes, its segments hold {total}")
                    moved += total
                if kind == "send":  # the message's device buffers (memory_model.py)
                    transient[src] += on_src
                    transient[dst] += on_dst
        if phase <= 1:
            _check_memory(_before_frees(k, len(rnd["ops"])), mem, transient,
                          capacity, peak)
        for (su, du, g, name, idx), handed in keeps.items():
            boxes = sorted(box for box, _ in handed)
            src_boxes, dst_boxes = _member_boxes(before[su][g][name], idx), _member_boxes(after[du][g][name], idx)
            if boxes != sorted(src_boxes) or boxes != sorted(dst_boxes):
                fail(f"{handed[0][1]}: keep of {name} on GPU {g} is not a whole identical shard",
                     hint="a partial shard on the same GPU is a copy")
            # a local tensor stacks its boxes in their listed order: the same boxes listed in
            # another order are another tensor, which the runtime must copy, not hand over
            if list(src_boxes) != list(dst_boxes):
                fail(f"{handed[0][1]}: keep of {name} on GPU {g} hands over a shard whose boxes the after "
                     "unit lists in another order", hint="a keep needs the same boxes in the same order; "
                                                         "a reordered shard is a copy")
        if progress is not None:
            progress("round", k + 1, len(rounds))
    last = f"after round {len(rounds) - 1} (the last)"
    for uid, per_gpu in after.items():
        for g, shards in per_gpu.items():
            if (uid, g) not in allocated:
                fail(f"{last}: after unit {uid} is never allocated on GPU {g}")
            for name, entries in shards.items():
                need = entries_volume(entries)
                got = written_volume.get((uid, g, name), 0)
                if got != need:
                    fail(f"{last}: after unit {uid} on GPU {g}: {name} has {got} of {need} elements written"
                         " (missing box)")
    for key, state in status.items():
        if state != "freed":
            fail(f"{last}: before unit {key[0]} on GPU {key[1]} is never freed")
    worst = max(peak, key=lambda g: (peak[g] / max(capacity[g], 1), -g)) if peak else 0
    return VerifyReport(len(rounds), ops, segments, moved, dict(peak), worst,
                        peak.get(worst, 0) / max(capacity[worst], 1) if peak else 0.0, memory_model=model)


def _kept_bytes(rounds: list, header: Header, cursor: _Cursor) -> tuple[dict, dict]:
    """Bytes handed over by keeps, per (after unit, GPU) and (before unit, GPU): an alloc or
    free declares its shard minus these. Checked segment by segment in the replay."""
    tensors = header.tensors
    kept_into, kept_out = defaultdict(int), defaultdict(int)
    for k, rnd in enumerate(rounds):
        for i, op in enumerate(rnd.get("ops", ()) if isinstance(rnd, dict) else ()):
            if isinstance(op, dict) and op.get("op") == "keep" and isinstance(op.get("segments"), list):
                cursor.where = f"round {k}, op {i} (keep)"
                for n, s in enumerate(op["segments"]):
                    if (not isinstance(s, dict) or not isinstance(s.get("tensor"), str) or s["tensor"] not in tensors
                            or not isinstance(s.get("src_unit"), str) or not isinstance(s.get("dst_unit"), str)
                            or not is_int(op.get("gpu"))):
                        continue  # the replay names it
                    box = s.get("box")
                    shape = tensors[s["tensor"]][0]
                    at = shard_at(s, s["tensor"], header.indices, cursor.where)
                    try:
                        b = count(at) * volume(check_box(box, shape, cursor.where, s["tensor"])) * tensors[s["tensor"]][1]
                    except BoxError as error:
                        error.path = ("rounds", k, "ops", i, "segments", n, "box") + error.path
                        raise
                    kept_into[(s.get("dst_unit"), op.get("gpu"))] += b
                    kept_out[(s.get("src_unit"), op.get("gpu"))] += b
    return kept_into, kept_out


def _member_boxes(entries, idx: tuple) -> tuple:
    """The boxes of the member at `idx` in shard `entries` ((at, boxes), ...)."""
    point = tuple((i, i + 1, 1) for i in idx)
    from nereus.ir.ranges import contains

    for at, boxes in entries:
        if contains(at, point):
            return boxes
    return ()


def _transfer(where, s, src, dst, header: Header, status, allocated, written, written_volume) -> tuple:
    if not isinstance(s, dict):
        fail(f"{where}: a segment is an object with tensor, box, src_unit and dst_unit")
    name = s.get("tensor")
    if not isinstance(name, str) or name not in header.tensors:
        fail(f"{where}: unknown tensor {name!r}")
    shape, element_bytes = header.tensors[name]
    box = check_box(s.get("box"), shape, where, name)
    at = shard_at(s, name, header.indices, where)
    su, du = s.get("src_unit"), s.get("dst_unit")
    if not isinstance(su, str) or su not in header.before:
        fail(f"{where}: source {su!r} is not a before unit")
    if not isinstance(du, str) or du not in header.after:
        fail(f"{where}: destination {du!r} is not an after unit")
    if header.stage_of[("before", su)] != header.stage_of[("after", du)]:
        fail(f"{where}: {name} of {du} sourced from {su}, another model-stage",
             hint="a box is sourced only from its own model-stage")
    state = status.get((su, src))
    if state is None:
        fail(f"{where}: source {su} holds nothing on GPU {src}")
    if state == "freed":
        fail(f"{where}: reads {name} from {su} on GPU {src} after its free (read after free)")
    if not holds(header.before[su][src].get(name, ()), at, box):
        fail(f"{where}: source {su} on GPU {src} does not hold {_label(name, at)} {list(box)}")
    if (du, dst) not in allocated:
        fail(f"{where}: writes into {du} on GPU {dst} before its alloc")
    if not holds(header.after[du][dst].get(name, ()), at, box):
        fail(f"{where}: {du} on GPU {dst} has no box of {_label(name, at)} containing {list(box)}")
    done = written[(du, dst, name)]
    mask = member_mask(at, header.sizes(name))
    for other, other_mask in done.items():
        if other_mask & mask and (other == box or overlap(box, other)):
            fail(f"{where}: {_label(name, at)} {list(box)} on GPU {dst} written twice (double write)")
    done[box] = done.get(box, 0) | mask
    n = count(at) * volume(box)
    written_volume[(du, dst, name)] += n
    return n * element_bytes, at, box


def _before_frees(k: int, first_free: int) -> str:
    """Where a round's memory is checked: after its allocs and transfers (ops before
    `first_free`), before its stage_outs and frees."""
    if first_free == 0:
        return f"round {k}, at its start (no allocs or transfers)"
    if first_free == 1:
        return f"round {k}, op 0 (allocs and transfers)"
    return f"round {k}, ops 0-{first_free - 1} (allocs and transfers)"


def _check_memory(where, mem, transient, capacity, peak) -> None:
    for g in set(mem) | set(transient):
        used = mem[g] + transient.get(g, 0)
        peak[g] = max(peak.get(g, 0), used)
        if used > capacity[g]:
            fail(f"{where}: GPU {g} needs {human_bytes(used)}, capacity {human_bytes(capacity[g])}"
                 f" (over by {human_bytes(used - capacity[g])})",
                 hint="memory = resident + unfreed before-shards + allocations + send buffers")

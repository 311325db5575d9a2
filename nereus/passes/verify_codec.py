"""verify_codec: the proof of a weight-sync codec program (header fields `delta`, `quant`).

Input: a whole program dict with `delta` and/or `quant` (docs/program.md, "Weight-sync
codecs"; made by nereus.passes.delta and nereus.passes.quantize) and the prover of dense
programs (verify.py's replay). Output: its VerifyReport (bytes: what the codec program
declares), or a ProgramError naming the round and op (or header field).

Proven statically:
  1. `dense_of(program)` — the same ops and segments without `amax` ops and encodings,
     bytes counted in the tensors' own dtypes — passes the whole replay: every after box is
     written exactly once from a live source of its model-stage, and memory stays within
     capacity with, on every GPU, each delta send's persistent reference (its declared
     bytes, kept by the sender between runs) and the largest round's worst-case encoded
     buffers (`nereus.passes.delta.encoded_bound`, on both ends) added to its resident bytes;
  2. quant: the header is well formed; no keep hands over a quantized tensor; every copy
     and send declares 1 byte per quantized element plus 4 per scale it carries (the
     blocks whose origin it writes, so each scale travels exactly once) and at most its
     dense bytes; every alloc declares its shards at those sizes; a quantized shard is no
     larger than its dense form (so the memory bound of 1. holds for the FP8 program);
  3. quant: every block's scale is computed from the whole block: for a block that two or
     more GPUs write, each of them covers the whole block with its own segments and the
     parts of `amax` ops it receives (all in round 0, run before any transfer while every
     source is live), each part inside the block and inside a box its sender holds;
  4. delta: a send is marked `"encoding": "delta"` only in a program with a valid `delta`.
Not provable statically, hence checked at run time (nereus.runtime.codec_sync): which
words of a delta message changed. Each receiver applies the message to the region it
holds from the last run of the same program (the runtime runs a delta only then, and on
every rank alike), then compares a checksum of the whole resulting region with the one
the sender computed over its full, current region; any difference (a changed word left
out, a stale base) makes every rank raise and the next sync a full one.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

from nereus.ir.diagnostics import ProgramError
from nereus.ir.scale_blocks import block_rect, grid, intersect, local_shape, to_local, uncovered

from .delta import check_chunk, encoded_bound
from .quantize import Sizes, as_box, shard_index, straddling, volume, writers
from .verify_header import fail, is_int

FORMATS = {"fp8_e4m3": 1}  # quant format -> bytes per code


def is_codec(data) -> bool:
    """Whether `data` uses a codec field: a header field `delta` or `quant`, an `amax` op or
    a send's `encoding` (a program that drops its header but keeps encoded sends is a
    codec program whose header is missing, not a dense one)."""
    if not isinstance(data, dict):
        return False
    if "delta" in data or "quant" in data:
        return True
    return any(isinstance(op, dict) and (op.get("op") == "amax" or "encoding" in op)
               for rnd in _list(data.get("rounds")) for op in _list(rnd.get("ops") if isinstance(rnd, dict) else None))


def verify_codec(data: dict, prove_dense: Callable):
    """See the module docstring. `prove_dense(dense_program)` returns its VerifyReport."""
    from dataclasses import replace

    if data.get("version") != 1:
        fail(f"codec fields (delta, quant, amax ops, encodings) extend version 1 programs, this one is version "
             f"{data.get('version')!r}", hint="nereus.passes.delta and quantize emit version 1")
    quant = _quant_header(data)
    chunk = None
    if "delta" in data:
        spec = data["delta"]
        if not isinstance(spec, dict):
            fail("header field 'delta' must be {\"chunk\": C}")
        try:
            chunk = check_chunk(spec.get("chunk"))
        except ProgramError as error:
            fail(f"header field 'delta': {error.message}", hint=error.hint)
    for k, rnd in enumerate(_list(data.get("rounds"))):
        for i, op in enumerate(_list(rnd.get("ops") if isinstance(rnd, dict) else None)):
            if isinstance(op, dict) and op.get("op") == "amax" and quant is None:
                fail(f"round {k}, op {i} (amax): an amax op in a program without header field 'quant'")
            if isinstance(op, dict) and "encoding" in op:
                where = f"round {k}, op {i} ({op.get('op')})"
                if op.get("op") != "send" or op["encoding"] != "delta":
                    fail(f"{where}: unknown encoding {op['encoding']!r}", hint="sends may be \"encoding\": \"delta\"")
                if chunk is None:
                    fail(f"{where}: a delta send in a program without header field 'delta'",
                         hint="nereus.passes.delta sets both")
    report = prove_dense(dense_of(data, quant, chunk))
    moved = _check_quant(data, quant) if quant is not None else report.bytes_moved
    return replace(report, bytes_moved=moved)


def _list(value) -> list:
    return value if isinstance(value, list) else []


def _quant_header(data: dict):
    """(quantized names, block) of header field `quant`, or None."""
    if "quant" not in data:
        return None
    spec = data["quant"]
    if not isinstance(spec, dict) or spec.get("format") not in FORMATS or spec.get("scale_dtype") != "fp32":
        fail("header field 'quant' must be {\"format\": \"fp8_e4m3\", \"block\": [B, B], \"scale_dtype\": \"fp32\", "
             "\"tensors\": [...]}", hint="nereus.passes.quantize writes it")
    block = spec.get("block")
    if not (isinstance(block, list) and len(block) == 2 and all(is_int(b) and b > 0 for b in block)
            and block[0] == block[1]):
        fail(f"header field 'quant': block {block!r} is not [B, B] with B > 0")
    shapes = {t.get("name"): t.get("shape") for t in _list(data.get("tensors")) if isinstance(t, dict)}
    names = spec.get("tensors")
    if not isinstance(names, list) or len(set(map(str, names))) != len(names):
        fail("header field 'quant': 'tensors' must list distinct tensor names")
    for name in names:
        if name not in shapes or not isinstance(shapes[name], list) or len(shapes[name]) != 2:
            fail(f"header field 'quant': {name!r} is not a 2-D tensor of the program")
    return set(names), block[0]


def dense_of(data: dict, quant, chunk) -> dict:
    """The dense program a codec program encodes (module docstring, 1.). Ops it cannot
    read are left as they are, for the replay to name."""
    names, block = quant if quant is not None else (set(), 0)
    tensors = {t["name"]: t for t in _list(data.get("tensors")) if isinstance(t, dict) and "name" in t}
    sizes = Sizes(tensors, {}, set(), block)
    kept = defaultdict(int)
    rounds, extra, reference = [], defaultdict(int), defaultdict(int)
    for rnd in _list(data.get("rounds")):
        if not isinstance(rnd, dict):
            rounds.append(rnd)
            continue
        ops, buffers = [], defaultdict(int)
        for op in _list(rnd.get("ops")):
            if not isinstance(op, dict) or op.get("op") == "amax":
                if not isinstance(op, dict):
                    ops.append(op)
                continue
            op = {k: v for k, v in op.items() if k != "encoding"}
            segments = op.get("segments")
            dense = _dense_bytes(sizes, segments)
            if names and op.get("op") in ("copy", "send") and dense is not None:
                declared, op["bytes"] = op.get("bytes"), dense
            else:
                declared = op.get("bytes")
            if op.get("op") == "keep" and dense is not None:
                for s in segments:
                    kept[(s["dst_unit"], op.get("gpu"))] += sizes.dense_segment(s)
            if op.get("op") == "send" and chunk is not None and is_int(declared):
                bound = encoded_bound(declared, chunk)
                reference[op.get("src")] += declared
                buffers[op.get("src")] += bound
                buffers[op.get("dst")] += bound
            ops.append(op)
        for gpu, nbytes in buffers.items():
            extra[gpu] = max(extra[gpu], nbytes)
        rounds.append(dict(rnd, ops=ops))
    out = {k: v for k, v in data.items() if k not in ("delta", "quant")}
    out["rounds"] = rounds
    if names:
        _dense_allocs(out, sizes, kept)
    if reference or extra:
        resident = dict(data.get("resident_bytes") or {})
        for gpu in set(reference) | set(extra):
            if is_int(resident.get(str(gpu), 0)):
                resident[str(gpu)] = resident.get(str(gpu), 0) + reference[gpu] + extra[gpu]
        out["resident_bytes"] = resident
    return out


def _dense_bytes(sizes: Sizes, segments):
    try:
        return sum(sizes.dense_segment(s) for s in segments)
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def _dense_allocs(program: dict, sizes: Sizes, kept: dict) -> None:
    try:
        after = shard_index(program["units"]["after"])
    except (KeyError, TypeError, ValueError, AttributeError):
        return  # the replay names the malformed unit
    whole = defaultdict(int)
    for (unit, gpu, name), boxes in after.items():
        whole[(unit, gpu)] += sum(volume(b) for b in boxes) * sizes.element(name)
    for rnd in program["rounds"]:
        for op in _list(rnd.get("ops") if isinstance(rnd, dict) else None):
            if isinstance(op, dict) and op.get("op") == "alloc" and (op.get("unit"), op.get("gpu")) in whole:
                op["bytes"] = whole[(op["unit"], op["gpu"])] - kept[(op["unit"], op["gpu"])]


def _check_quant(data: dict, quant) -> int:
    """Proofs 2 and 3 of the module docstring on a program whose dense form verified;
    returns the bytes its copies and sends declare."""
    names, block = quant
    tensors = {t["name"]: t for t in data["tensors"]}
    after = shard_index(data["units"]["after"])
    before = shard_index(data["units"]["before"])
    sizes = Sizes(tensors, after, names, block)
    kept, whole, moved = defaultdict(int), defaultdict(int), 0
    for (unit, gpu, name), boxes in after.items():
        whole[(unit, gpu)] += sizes.shard(name, boxes)
        if name in names and sizes.shard(name, boxes) > sum(volume(b) for b in boxes) * sizes.element(name):
            fail(f"header field 'units.after' (unit {unit}): its shard of {name} on GPU {gpu} is larger quantized "
                 "than dense", hint="quantize only weights with at least 4 elements per block")
    received = defaultdict(list)  # (gpu, tensor, dst unit, shard gpu, block) -> local rects its amax ops cover
    for k, rnd in enumerate(data["rounds"]):
        for i, op in enumerate(rnd["ops"]):
            kind, where = op["op"], f"round {k}, op {i} ({op['op']})"
            if kind == "amax":
                _check_amax(op, k, where, after, before, names, block, received)
            elif kind == "keep":
                for s in op["segments"]:
                    if s["tensor"] in names:
                        fail(f"{where}: keeps {s['tensor']}, which the after unit holds quantized",
                             hint="a keep hands a shard over as it is; nereus.passes.quantize makes it a copy")
                    kept[(s["dst_unit"], op["gpu"])] += sizes.dense_segment(s)
            elif kind in ("copy", "send"):
                dst = op["dst"] if kind == "send" else op["gpu"]
                nbytes = sum(sizes.segment(s, dst) for s in op["segments"])
                dense = sum(sizes.dense_segment(s) for s in op["segments"])
                if op.get("bytes") != nbytes:
                    fail(f"{where}: declares {op.get('bytes')} bytes, its segments hold {nbytes} quantized "
                         f"({dense} dense)", hint="1 byte per quantized element, 4 per scale whose block origin "
                                                  "the segment writes")
                if nbytes > dense:
                    fail(f"{where}: moves {nbytes} bytes quantized, more than its {dense} dense bytes",
                         hint="the memory proof bounds the quantized program by the dense one")
                moved += nbytes
    for k, rnd in enumerate(data["rounds"]):
        for i, op in enumerate(rnd["ops"]):
            if op["op"] == "alloc":
                expected = whole[(op["unit"], op["gpu"])] - kept[(op["unit"], op["gpu"])]
                if op["bytes"] != expected:
                    fail(f"round {k}, op {i} (alloc): declares {op['bytes']} bytes, the quantized shards need "
                         f"{expected}")
    _check_scales(data["rounds"], after, names, block, received)
    return moved


def _check_amax(op, k, where, after, before, names, block, received) -> None:
    src, dst, entries = op.get("src"), op.get("dst"), op.get("entries")
    if k != 0:
        fail(f"{where}: amax ops run before the first transfer, in round 0", hint="nereus.passes.quantize puts them there")
    if not is_int(src) or not is_int(dst) or src == dst or not isinstance(entries, list):
        fail(f"{where}: an amax op has distinct GPUs src and dst and a list of entries")
    if op.get("bytes") != 4 * len(entries):
        fail(f"{where}: declares {op.get('bytes')} bytes for {len(entries)} fp32 maxima")
    for n, entry in enumerate(entries):
        at = f"{where}, entry {n}"
        if not isinstance(entry, dict) or entry.get("tensor") not in names:
            fail(f"{at}: names no quantized tensor")
        name, unit, gpu, ij = entry["tensor"], entry.get("dst_unit"), entry.get("gpu"), entry.get("block")
        boxes = after.get((unit, gpu, name))
        if boxes is None:
            fail(f"{at}: {unit} holds no shard of {name} on GPU {gpu}")
        rows, cols = grid(local_shape(boxes), block)
        if not (isinstance(ij, list) and len(ij) == 2 and all(is_int(x) for x in ij)
                and 0 <= ij[0] < rows and 0 <= ij[1] < cols):
            fail(f"{at}: block {ij!r} is not in the {rows} x {cols} scale grid of {name} on GPU {gpu}")
        whole = block_rect(ij[0], ij[1], local_shape(boxes), block)
        parts = entry.get("parts")
        if not isinstance(parts, list) or not parts:
            fail(f"{at}: lists no parts")
        for part in parts:
            held = before.get((part.get("src_unit"), src, name)) if isinstance(part, dict) else None
            box = part.get("box") if isinstance(part, dict) else None
            if held is None or not _is_box(box) or not any(_inside(as_box(box), b) for b in held):
                fail(f"{at}: part {part!r} is not a box of {name} that GPU {src} holds")
            rects = to_local(boxes, as_box(box))
            if sum(volume(((a, b), (c, d))) for a, b, c, d in rects) != volume(as_box(box)) or \
                    any(intersect(r, whole) != r for r in rects):
                fail(f"{at}: part {box} lies outside block {ij} of {name} on GPU {gpu}")
            received[(dst, name, unit, gpu, tuple(ij))].extend(rects)


def _check_scales(rounds, after, names, block, received) -> None:
    """Proof 3: each writer of a block written by several GPUs covers the whole block."""
    for key, written in writers(rounds, after, names).items():
        unit, gpu, name = key
        for (i, j), items in straddling(after[key], written, block).items():
            whole = block_rect(i, j, local_shape(after[key]), block)
            gpus = sorted({src for src, _, _ in items})
            for c in gpus:
                own = [r for r in (intersect(rect, whole) for src, _, rect in items if src == c) if r]
                gap = uncovered(whole, own + received.get((c, name, unit, gpu, (i, j)), []))
                if gap is not None:
                    fail(f"after round {len(rounds) - 1} (the last): block ({i}, {j}) of {name} on GPU {gpu} "
                         f"({unit}) is written by GPUs {gpus}, and GPU {c} never learns local rows {gap[0]}..{gap[1]}"
                         f", columns {gap[2]}..{gap[3]} of it: its scale would not come from the whole block",
                         hint="every GPU that writes part of a block needs an amax op (round 0) from each other "
                              "writer; nereus.passes.quantize adds them")


def _is_box(box) -> bool:
    return isinstance(box, list) and len(box) == 2 and all(
        isinstance(p, list) and len(p) == 2 and all(is_int(x) for x in p) and p[0] < p[1] for p in box)


def _inside(inner, outer) -> bool:
    return all(a >= c and b <= d for (a, b), (c, d) in zip(inner, outer))

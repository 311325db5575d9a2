"""verify_fields: the fields of a JSON program v1 that no reader knows → warnings.

Input: a program dict (docs/program.md). Output: one message per unknown field, naming
where it is and the known field it is closest to. Invariant: a program the emitter
writes (whole or one rank's part) yields none.

Why warnings, not errors: v1 grows by optional fields (`nodes`, `zero` and `dp` came
later), so a reader must accept fields it does not know; but a misspelled optional field
(`capacity_byte`) silently falls back to its default and changes what is proven, which a
warning makes visible.
"""

from __future__ import annotations

import difflib

_OP = {"op", "id", "index", "round"}
FIELDS = {
    "top": {"format", "version", "transition", "gpus", "nodes", "tensors", "units", "resident_bytes", "untouched",
            "rounds", "rank", "peers", "memory_model", "quant", "delta"},
    "gpus": {"id", "node", "mem_bytes", "capacity_bytes"},
    "nodes": {"id", "host_mem_bytes"},
    "tensors": {"name", "shape", "dtype"},
    "units": {"before", "after"},
    "unit": {"id", "model_stage", "replica", "gpus", "tp", "pp", "ep", "dp", "zero", "offload", "mesh", "shards"},
    "shard": {"gpu", "tensor", "boxes"},
    "round": {"ops"},
    "alloc": _OP | {"gpu", "unit", "bytes"},
    "free": _OP | {"gpu", "unit", "bytes"},
    "stage_out": _OP | {"gpu", "unit", "bytes"},
    "keep": _OP | {"gpu", "segments", "src_unit", "dst_unit"},
    "copy": _OP | {"gpu", "segments", "bytes", "src_unit", "dst_unit"},
    "send": _OP | {"src", "dst", "segments", "bytes", "src_unit", "dst_unit", "encoding"},
    "amax": _OP | {"src", "dst", "entries", "bytes"},  # weight-sync codec programs (verify_codec.py)
    "segment": {"tensor", "box", "src_unit", "dst_unit"},
}
# version 2 (docs/program.md, "Version 2: ranges"): tensor families and their ranges
RANGED = {"tensors": {"indices"}, "shard": {"at"}, "segment": {"at"}}
MAX_WARNINGS = 20


def unknown_fields(data) -> list[str]:
    """Messages for the fields of `data` outside FIELDS (at most MAX_WARNINGS, then a count)."""
    out: list[str] = []
    ranged = isinstance(data, dict) and data.get("version") == 2

    def check(obj, kind: str, where: str) -> None:
        if not isinstance(obj, dict):
            return
        known = FIELDS[kind] | RANGED.get(kind, set()) if ranged else FIELDS[kind]
        for key in obj:
            if key not in known:
                close = difflib.get_close_matches(str(key), sorted(known), n=1)
                out.append(f"{where}: unknown field {str(key)[:60]!r}"
                           + (f" (did you mean {close[0]!r}?)" if close else "") + ": ignored")

    def items(value):
        return value if isinstance(value, list) else []

    check(data, "top", "the program")
    if not isinstance(data, dict):
        return out
    for field in ("gpus", "nodes", "tensors"):
        for i, entry in enumerate(items(data.get(field))):
            check(entry, field, f"header field '{field}' (entry {i})")
    units = data.get("units")
    check(units, "units", "header field 'units'")
    for side in ("before", "after"):
        for i, unit in enumerate(items(units.get(side) if isinstance(units, dict) else None)):
            where = f"header field 'units.{side}' (unit {unit.get('id', i) if isinstance(unit, dict) else i})"
            check(unit, "unit", where)
            for j, shard in enumerate(items(unit.get("shards") if isinstance(unit, dict) else None)):
                check(shard, "shard", f"{where}, shard {j}")
    for k, rnd in enumerate(items(data.get("rounds"))):
        check(rnd, "round", f"round {k}")
        for i, op in enumerate(items(rnd.get("ops") if isinstance(rnd, dict) else None)):
            kind = op.get("op") if isinstance(op, dict) else None
            if kind in FIELDS:
                check(op, kind, f"round {k}, op {i} ({kind})")
                for s in items(op.get("segments")):
                    check(s, "segment", f"round {k}, op {i} ({kind}), a segment")
    if len(out) > MAX_WARNINGS:
        out = out[:MAX_WARNINGS] + [f"... and {len(out) - MAX_WARNINGS} more unknown fields"]
    return out

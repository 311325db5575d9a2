"""Rank programs: one rank's part of a JSON program (v2, or v1), lowered from the symbolic
program without emitting the whole (docs/program.md, "Rank programs").

    rank_program_json(compiled, rank, version=2) -> dict  # a CompiledTransition or lowered Program
    split_by_rank(whole) -> {rank: dict}          # the same parts, cut from a whole v1 dict
    rank_digests(whole) -> {rank: sha256}; rank_digest(part) -> sha256

Input: a compiled transition and a rank (its GPU id). Output: a v1 dict with the same
fields as the whole program, holding only what that rank executes and reads:
  - `rounds`: every round (same count), each with the rank's ops only — its allocs, keeps,
    copies, frees, stage_outs and every send it is the source or the destination of — with
    the `id` each op has in the whole program and its `index`, the op's position in its
    round of the whole program (sender and receiver agree on it: it is the message tag);
    an op whose segments all name one (src_unit, dst_unit) pair states it once, at the op
    level (`compact_segment_units`; readers call `expand_segment_units`);
  - `units`: the units that hold state on the rank, with the rank's shards, plus the units
    its messages read from or write to, with just the shards of the peer GPU that those
    messages name (the segment tables: enough to pack and unpack both sides);
  - `tensors`, `gpus`, `nodes`, `resident_bytes`: only those the above refer to (the rank
    and its peers); `rank` and `peers` say whose program it is; `memory_model` as the
    whole program's.
Invariant (tested): equal to the whole program filtered to the rank. Cost: the symbolic
program's op records are walked once (cheap: an op covers a layer range), and only the
rank's ops and shards are expanded into per-layer segments, so the size of one rank's
program does not grow with the number of GPUs for a fixed per-rank shard.
"""

from __future__ import annotations

from collections import defaultdict

from nereus.ir.program import compact_segment_units, expand_segment_units
from nereus.passes.memory_model import FIELD as MEMORY_MODEL

from .json_program import FORMAT, VERSION, check_version, op_json, tensors_json, unit_json


def _involves(dag, kind: str, record, rank: int) -> bool:
    if kind == "send":
        return rank in (record.src, record.dst)
    if kind == "alloc":
        return dag.allocs[record].gpu == rank
    if kind in ("free", "stage_out"):
        return dag.frees[record].gpu == rank
    return record.dst_gpu == rank


def rank_program_json(compiled, rank: int, version: int = VERSION) -> dict:
    """Rank `rank`'s program (module docstring), in JSON program `version` (2: ranges)."""
    from nereus.passes.manager import paused_gc

    check_version(version)
    with paused_gc():  # thousands of small dicts and lists, none cyclic
        return _rank_program_json(compiled, rank, version == 2)


def _rank_program_json(compiled, rank: int, ranged: bool) -> dict:
    from nereus.passes.layout import unit_id

    program = getattr(compiled, "program", compiled)
    dag = program.dag
    cluster = dag.module.cluster
    if not 0 <= rank < cluster.num_gpus:
        from nereus.ir.diagnostics import SemanticError

        raise SemanticError(f"rank {rank} is not a GPU of the cluster", hint=f"ranks run 0..{cluster.num_gpus - 1}")
    rounds: list[dict] = [{"ops": []} for _ in range(program.num_rounds)]
    touched: dict = defaultdict(lambda: defaultdict(set))  # (side, unit id) -> gpu -> tensor names
    peers: set[int] = set()
    next_id, current, index = 0, -1, 0
    for k, kind, record in program.ops():
        if k != current:
            current, index = k, 0
        if _involves(dag, kind, record, rank):
            op = op_json(dag, kind, record, ranged)
            op["id"], op["round"], op["index"] = next_id, k, index
            rounds[k]["ops"].append(compact_segment_units(op))
            if kind == "send":
                peers.add(op["dst"] if op["src"] == rank else op["src"])
                for seg in op["segments"]:
                    touched[("before", seg["src_unit"])][op["src"]].add(seg["tensor"])
                    touched[("after", seg["dst_unit"])][op["dst"]].add(seg["tensor"])
        next_id += 1
        index += 1
    units: dict = {"before": [], "after": []}
    for info in dag.stages:
        for side, placement in (("before", info.before), ("after", info.after)):
            mine = _replica_of(placement, rank)
            for r in range(placement.dp):
                uid = unit_id(info.name, r)
                only = {g: set(names) for g, names in touched.get((side, uid), {}).items()}
                if r == mine:
                    only[rank] = None
                if only:
                    units[side].append(unit_json(info.model, placement, r, only, ranged))
    names = {s["tensor"] for side in units.values() for u in side for s in u["shards"]}
    tensors, seen = [], set()
    for info in dag.stages:
        for entry in tensors_json(info.model, info.states, ranged):
            if entry["name"] in names and entry["name"] not in seen:
                seen.add(entry["name"])
                tensors.append(entry)
    gpus = sorted(peers | {rank})
    return {
        "format": FORMAT, "version": 2 if ranged else 1,
        "transition": {"from": dag.source, "to": dag.target},
        "rank": rank,
        "peers": sorted(peers),
        "gpus": [{"id": g, "node": cluster.node_of(g), "mem_bytes": cluster.gpu.mem_bytes,
                  "capacity_bytes": cluster.usable_gpu_bytes} for g in gpus],
        "nodes": [{"id": n, "host_mem_bytes": cluster.host_mem_bytes}
                  for n in sorted({cluster.node_of(g) for g in gpus})],
        "tensors": tensors,
        "units": units,
        "resident_bytes": {str(g): dag.resident[g] for g in gpus},
        "untouched": list(dag.untouched),
        "memory_model": program.schedule.memory_model,
        "rounds": rounds,
    }


def _replica_of(placement, gpu: int):
    """The replica of `placement` that holds `gpu`, or None."""
    try:
        return placement.gpus.index(gpu) // (placement.pp * placement.stage_width)
    except ValueError:
        return None


def canonical_json(rank_program: dict) -> str:
    """A rank program's canonical JSON text (sorted keys, no spaces): what digests hash."""
    import json

    return json.dumps(rank_program, sort_keys=True, separators=(",", ":"))


def rank_digest(rank_program: dict) -> str:
    """SHA-256 of a rank program's canonical JSON: what a rank compares against the
    digest its part had in the verified whole program."""
    import hashlib

    return hashlib.sha256(canonical_json(rank_program).encode()).hexdigest()


def split_by_rank(whole: dict) -> dict[int, dict]:
    """Every rank's program cut out of a whole program (v1 dict) in one pass: the same
    dicts `rank_program_json` lowers (tested). For the place that verifies the whole
    program once: `rank_digests` of it let each rank check the part it lowered alone."""
    whole = expand_segment_units(whole)
    gpu_info = {g["id"]: g for g in whole["gpus"]}
    node_info = {n["id"]: n for n in whole.get("nodes", [])}
    ranks = sorted(gpu_info)
    rounds = {r: [{"ops": []} for _ in whole["rounds"]] for r in ranks}
    peers: dict = defaultdict(set)
    readers: dict = defaultdict(set)  # (side, unit, gpu, tensor) -> peer ranks whose messages name it
    for k, rnd in enumerate(whole["rounds"]):
        for index, op in enumerate(rnd["ops"]):
            if op["op"] == "send":
                src, dst = op["src"], op["dst"]
                compact = compact_segment_units(dict(op, index=index))
                for rank in (src, dst):
                    rounds[rank][k]["ops"].append(compact)
                peers[src].add(dst)
                peers[dst].add(src)
                for seg in op["segments"]:
                    readers[("before", seg["src_unit"], src, seg["tensor"])].add(dst)
                    readers[("after", seg["dst_unit"], dst, seg["tensor"])].add(src)
            else:
                rounds[op["gpu"]][k]["ops"].append(compact_segment_units(dict(op, index=index)))
    units: dict = {r: {"before": [], "after": []} for r in ranks}
    for side, listing in whole["units"].items():
        for unit in listing:
            shards: dict = defaultdict(list)
            for shard in unit["shards"]:
                for rank in {shard["gpu"]} | readers.get((side, unit["id"], shard["gpu"], shard["tensor"]), set()):
                    shards[rank].append(shard)
            for rank in set(shards) | set(unit["gpus"]):
                units[rank][side].append(dict(unit, shards=shards.get(rank, [])))
    out = {}
    for rank in ranks:
        names = {s["tensor"] for side in units[rank].values() for u in side for s in u["shards"]}
        gpus = sorted(peers[rank] | {rank})
        out[rank] = {
            "format": whole["format"], "version": whole["version"], "transition": whole["transition"],
            "rank": rank, "peers": sorted(peers[rank]),
            "gpus": [gpu_info[g] for g in gpus],
            "nodes": [node_info[n] for n in sorted({gpu_info[g]["node"] for g in gpus}) if n in node_info],
            "tensors": [t for t in whole["tensors"] if t["name"] in names],
            "units": units[rank],
            "resident_bytes": {str(g): whole["resident_bytes"][str(g)] for g in gpus},
            "untouched": whole["untouched"],
            "rounds": rounds[rank],
        }
        if MEMORY_MODEL in whole:  # a program before the field has parts without it
            out[rank][MEMORY_MODEL] = whole[MEMORY_MODEL]
    return out


def rank_digests(whole: dict) -> dict[int, str]:
    """{rank: rank_digest of its part} of a whole program (see `split_by_rank`)."""
    return {rank: rank_digest(part) for rank, part in split_by_rank(whole).items()}

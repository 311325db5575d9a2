"""The baselines Nereus is compared with on GPUs: torch.distributed.checkpoint save +
load, and gather-then-scatter. Both run over the default process group (NCCL on CUDA
tensors, gloo on CPU ones) and return new local shards in the runtime's local-shard
format (boxes stacked along dim 0), so the same reference check applies to all three.

Adapted from benchmarks/reshard_vs_checkpoint.py (CPU/gloo) for tensors on a device.
"""

from __future__ import annotations

import os
import shutil
import time

import torch
import torch.distributed as dist

from mg_common import Env, my_shards

from nereus.runtime.state import box_piece


def _boxes(raw) -> list:
    return [tuple(map(tuple, b)) for b in raw]


# -- gather then scatter -----------------------------------------------------------------

def gather_scatter(env: Env, units_a: list, units_b: list, local: dict, specs: dict) -> dict:
    """Collective. Every tensor gathered whole on rank 0, then each new shard sent to its
    holder (how verl and OpenRLHF move weights). Generous to the baseline: a GPU whose new
    shard has exactly the boxes it held keeps its tensor (no copy, no transfer), like
    Nereus's keep. Output: this rank's new shards."""
    from nereus.runtime.boxes import as_box, shard_shape
    from nereus.runtime.state import gather_to_root, shard_of, writers

    rank = env.rank
    write = writers(units_a)
    mine_a = my_shards(units_a, rank)
    holders = [s for u in units_b for s in u["shards"]]
    held_by = {(s["gpu"], s["tensor"]): _boxes(s["boxes"]) for u in units_a for s in u["shards"]}
    new = {}
    for name in sorted(n for n in specs if n in write):
        shape, dtype = specs[name]
        targets = [s for s in holders if s["tensor"] == name]
        moving = [s for s in targets if held_by.get((s["gpu"], name)) != _boxes(s["boxes"])]
        for s in targets:
            if s["gpu"] == rank and s not in moving:
                new[name] = local[name]  # same boxes as before: kept in place
        if not moving:
            continue
        full = torch.empty(shape, dtype=dtype, device=env.device) if rank == 0 else None
        gather_to_root(full, write[name], local.get(name), mine_a.get(name, []), rank)
        ops = []
        for s in moving:
            if rank == 0:
                piece = shard_of(full, s["boxes"])
                if s["gpu"] == 0:
                    new[name] = piece
                else:
                    ops.append(dist.P2POp(dist.isend, piece, s["gpu"]))
            elif s["gpu"] == rank:
                new[name] = torch.empty(shard_shape([as_box(b) for b in s["boxes"]]), dtype=dtype, device=env.device)
                ops.append(dist.P2POp(dist.irecv, new[name], 0))
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        del full
    return new


# -- torch.distributed.checkpoint ----------------------------------------------------------

def _sharded_tensor(pieces: list, shape, rank: int, device, group):
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor

    placement = f"rank:{rank}/{device}" if device.type == "cpu" else f"rank:{rank}/cuda:{device.index}"
    shards = [Shard(t, ShardMetadata([lo for lo, _ in box], [hi - lo for lo, hi in box], placement))
              for box, t in pieces]
    return ShardedTensor._init_from_local_shards(shards, list(shape), process_group=group)


def save_form(env: Env, units: list, local: dict, specs: dict, names: list) -> dict:
    """DCP state dict of `local` in layout `units`: every distinct box once, on its first
    holder, as one ShardedTensor per tensor over the default group."""
    from nereus.runtime.state import writers

    write = writers(units)
    mine = my_shards(units, env.rank)
    out = {}
    for name in names:
        pieces = [(box, box_piece(local[name], mine[name], i)) for g, i, box in write.get(name, ()) if g == env.rank]
        out[name] = _sharded_tensor(pieces, specs[name][0], env.rank, env.device, None)
    return out


def load_form(env: Env, units: list, target: dict, specs: dict, names: list, groups: dict) -> tuple[dict, list]:
    """DCP state dict to load into: per replica a ShardedTensor over that replica's group
    (a tensor the replica holds whole on every GPU is a plain tensor). A box that several
    GPUs of one replica hold (replicated KV heads) is loaded by its first holder only
    (a ShardedTensor's shards must not overlap); the second list gives the copies to make
    after the load: (tensor, view, src or dst rank, "send" | "recv")."""
    from nereus.runtime.state import writers

    mine = my_shards(units, env.rank)
    out, copies = {}, []
    for unit in units:
        if env.rank not in unit["gpus"]:
            continue
        first = writers([unit])
        for name in names:
            shape = specs[name][0]
            whole = tuple((0, n) for n in shape)
            partial = any(s["tensor"] == name and any(b != whole for b in _boxes(s["boxes"])) for s in unit["shards"])
            boxes = _boxes(mine.get(name, []))
            if not partial:
                if boxes:
                    out[name] = target[name]
                continue
            writer_of = {tuple(map(tuple, box)): g for g, _, box in first[name]}
            pieces = []
            for i, b in enumerate(boxes):
                view = box_piece(target[name], boxes, i)
                if writer_of[b] == env.rank:
                    pieces.append((b, view))
                else:
                    copies.append((name, view, writer_of[b], "recv"))
            for s in unit["shards"]:
                if s["tensor"] == name and s["gpu"] != env.rank:
                    for b in _boxes(s["boxes"]):
                        if writer_of[b] == env.rank:
                            copies.append((name, box_piece(target[name], boxes, boxes.index(b)), s["gpu"], "send"))
            out[name] = _sharded_tensor(pieces, shape, env.rank, env.device, groups[unit["id"]])
    return out, copies


def share_duplicates(copies: list) -> None:
    """Collective among the ranks concerned: first holders send duplicated boxes."""
    ops = [dist.P2POp(dist.isend if kind == "send" else dist.irecv, view.contiguous() if kind == "send" else view,
                      peer) for _, view, peer, kind in copies]
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()


def replica_groups(units: list) -> dict:
    """Collective (every rank, same order): a process group per replica of a layout."""
    return {u["id"]: dist.new_group(u["gpus"]) for u in units}


def dcp_save_load(env: Env, units_a: list, units_b: list, local: dict, specs: dict, names: list,
                  folder: str) -> tuple[float, float, dict]:
    """Collective. Save `names` of `local` (layout a) with torch.distributed.checkpoint to
    `folder` on local disk, then load them into empty tensors of layout b (DCP reshards
    on load). Returns (save seconds, load seconds, this rank's loaded shards), slowest
    rank each; the folder is removed afterwards."""
    import torch.distributed.checkpoint as dcp
    from nereus.runtime.boxes import as_box, shard_shape

    if env.rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder, exist_ok=True)
    state = save_form(env, units_a, local, specs, names)
    env.barrier()
    t0 = time.perf_counter()
    dcp.save(state, checkpoint_id=folder)
    env.sync()
    save_s = env.slowest(time.perf_counter() - t0)
    del state
    target = {n: torch.empty(shard_shape([as_box(b) for b in boxes]), dtype=specs[n][1], device=env.device)
              for n, boxes in my_shards(units_b, env.rank).items() if n in set(names)}
    groups = replica_groups(units_b)
    state, copies = load_form(env, units_b, target, specs, names, groups)
    env.barrier()
    t0 = time.perf_counter()
    dcp.load(state, checkpoint_id=folder)
    share_duplicates(copies)
    env.sync()
    load_s = env.slowest(time.perf_counter() - t0)
    del state
    env.barrier()
    if env.rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
    return save_s, load_s, target

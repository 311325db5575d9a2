"""Test helpers: an independent layout oracle, a naive reference program builder and a
gloo launcher. Nothing here is used by the runtime itself.

`oracle_units` re-derives docs/ir.md's layout rules (mesh order replica-major, then pp
stage, then tp; column part-wise with replicated KV heads when tp > kv_heads; row; vocab;
replicated; PP by `pp_layer_range`) so the executor can be tested without the compiler.
`naive_program` cuts every tensor into the grid of all box edges and moves each cell
from one holder (same GPU first), spreading sends over `rounds` rounds.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nereus.models import COLUMN, OPTIMIZER_STATES, REPLICATED, ROW, VOCAB, optimizer_name, \
    pp_layer_range, tensor_table
from nereus.ir.model import DTYPE_BYTES

import rank_rendezvous

ELEM = dict(DTYPE_BYTES, int64=8)


def _tp_boxes(spec, tp: int, t: int) -> list:
    shape = spec.shape
    rest = [[0, d] for d in shape[1:]]
    if spec.sharding == REPLICATED or tp == 1 and spec.sharding != COLUMN:
        return [[[0, d] for d in shape]]
    if spec.sharding == VOCAB:
        n = shape[0] // tp
        return [[[t * n, (t + 1) * n]] + rest]
    if spec.sharding == ROW:
        n = shape[1] // tp
        return [[[0, shape[0]], [t * n, (t + 1) * n]]]
    boxes, off = [], 0
    for part in spec.parts:
        per = part.rows // part.groups
        if tp <= part.groups:
            n = part.rows // tp
            boxes.append([[off + t * n, off + (t + 1) * n]] + rest)
        else:
            g = t // (tp // part.groups)
            boxes.append([[off + g * per, off + (g + 1) * per]] + rest)
        off += part.rows
    return boxes


def oracle_units(model, model_stage: str, dp: int, tp: int, pp: int, gpus: list) -> list:
    training = model_stage.endswith(".training")
    specs = tensor_table(model)
    units = []
    for r in range(dp):
        shards = []
        for p in range(pp):
            lo, hi = pp_layer_range(model.layers, pp, p)
            for t in range(tp):
                gpu = gpus[r * pp * tp + p * tp + t]
                for spec in specs:
                    keep = (spec.layer is not None and lo <= spec.layer < hi) or \
                        (spec.role == "embed" and p == 0) or (spec.role in ("head", "final_norm") and p == pp - 1)
                    if not keep:
                        continue
                    names = [f"{model.name}/{spec.name}"]
                    if training:
                        names += [optimizer_name(names[0], s) for s in OPTIMIZER_STATES]
                    for name in names:
                        shards.append({"gpu": gpu, "tensor": name, "boxes": _tp_boxes(spec, tp, t)})
        units.append({"id": f"{model_stage}/{r}", "model_stage": model_stage, "replica": r,
                      "gpus": list(gpus[r * pp * tp:(r + 1) * pp * tp]), "shards": shards})
    return units


def tensor_list(model, training: bool) -> list:
    out = []
    for spec in tensor_table(model):
        name = f"{model.name}/{spec.name}"
        out.append({"name": name, "shape": list(spec.shape), "dtype": spec.dtype})
        if training:
            out += [{"name": optimizer_name(name, s), "shape": list(spec.shape), "dtype": "fp32"}
                    for s in OPTIMIZER_STATES]
    return out


def _numel(box) -> int:
    n = 1
    for lo, hi in box:
        n *= hi - lo
    return n


def _inside(cell, box) -> bool:
    return all(blo <= lo and hi <= bhi for (lo, hi), (blo, bhi) in zip(cell, box))


def _cells(box, cuts):
    import itertools
    per_dim = []
    for d, (lo, hi) in enumerate(box):
        edges = sorted({lo, hi} | {c for c in cuts[d] if lo < c < hi})
        per_dim.append([[a, b] for a, b in zip(edges, edges[1:])])
    return [list(c) for c in itertools.product(*per_dim)]


def naive_program(before: list, after: list, tensors: list, rounds: int = 1, source="S1", target="S2",
                  gpus: int = 4, stage_out: bool = False) -> dict:
    """A correct (if unfused) JSON program v1 moving `before` units' state into `after`'s.
    With stage_out, every before-unit is staged to host memory at the end of round 0 and
    the sends (rounds 1..rounds) read it from there."""
    dtype = {t["name"]: t["dtype"] for t in tensors}

    def shard_bytes(unit, gpu):
        return sum(_numel(b) * ELEM[dtype[s["tensor"]]] for s in unit["shards"] if s["gpu"] == gpu for b in s["boxes"])

    holders = {}
    for unit in before:
        for s in unit["shards"]:
            holders.setdefault(s["tensor"], []).append((unit["id"], s["gpu"], s["boxes"]))
    cuts = {}
    for unit in before + after:
        for s in unit["shards"]:
            c = cuts.setdefault(s["tensor"], None) or [set() for _ in s["boxes"][0]]
            cuts[s["tensor"]] = c
            for b in s["boxes"]:
                for d, (lo, hi) in enumerate(b):
                    c[d] |= {lo, hi}
    first = 1 if stage_out else 0
    ops = [[] for _ in range(rounds + first + 1)]
    for unit in after:
        for g in unit["gpus"]:
            ops[0].append({"op": "alloc", "gpu": g, "unit": unit["id"], "bytes": shard_bytes(unit, g)})
    local, remote = {}, {}
    n_send = 0
    for unit in after:
        for s in unit["shards"]:
            for box in s["boxes"]:
                for cell in _cells(box, cuts[s["tensor"]]):
                    srcs = [(u, g) for u, g, bs in holders[s["tensor"]] if any(_inside(cell, b) for b in bs)]
                    same = [x for x in srcs if x[1] == s["gpu"]]
                    src_unit, src_gpu = (same or srcs)[0]
                    seg = {"tensor": s["tensor"], "box": cell, "src_unit": src_unit, "dst_unit": unit["id"]}
                    if src_gpu == s["gpu"]:
                        local.setdefault(s["gpu"], []).append(seg)
                    else:
                        key = (first + n_send % rounds, src_gpu, s["gpu"])
                        remote.setdefault(key, []).append(seg)
                        n_send += 1
    for g, segs in sorted(local.items()):
        ops[0].append({"op": "copy", "gpu": g, "segments": segs,
                       "bytes": sum(_numel(x["box"]) * ELEM[dtype[x["tensor"]]] for x in segs)})
    for (r, src, dst), segs in sorted(remote.items()):
        ops[r].append({"op": "send", "src": src, "dst": dst, "segments": segs,
                       "bytes": sum(_numel(x["box"]) * ELEM[dtype[x["tensor"]]] for x in segs)})
    for unit in before:
        for g in unit["gpus"]:
            if stage_out:
                ops[0].append({"op": "stage_out", "gpu": g, "unit": unit["id"], "bytes": shard_bytes(unit, g)})
            ops[-1].append({"op": "free", "gpu": g, "unit": unit["id"], "bytes": shard_bytes(unit, g)})
    return {"format": "nereus-program", "version": 1, "transition": {"from": source, "to": target},
            "gpus": [{"id": i, "node": 0, "mem_bytes": 1 << 30} for i in range(gpus)],
            "tensors": tensors, "units": {"before": before, "after": after},
            "resident_bytes": {str(i): 0 for i in range(gpus)},
            "rounds": [{"ops": o} for o in ops]}


def reference_state(tensors: list, seed: int = 0) -> dict:
    """Full tensors with distinct values (so any misplaced element shows)."""
    gen = torch.Generator().manual_seed(seed)
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    return {t["name"]: torch.randn(t["shape"], generator=gen).to(dt[t["dtype"]]) for t in tensors}


def registered(source: str, plan: str, stages, rank: int, world: int, seed: int, **options) -> tuple:
    """(a Runtime of `source` at `plan` with every model-stage of `stages` registered from
    seeded full state dicts, {model-stage: full state dict}); options go to Runtime."""
    from nereus.ir import parse_source
    from nereus.runtime import Runtime

    rt = Runtime(parse_source(source, "test.nir"), plan, rank=rank, world_size=world, **options)
    gen = torch.Generator().manual_seed(seed)
    full = {}
    for ms in stages:
        full[ms] = {name: (torch.tensor(3, dtype=torch.int64) if name.endswith("#step")
                           else torch.randn(shape, generator=gen).to(dtype))
                    for name, (shape, dtype) in rt.tensor_specs(ms).items()}
        rt.register(ms, rt.shard_state_dict(ms, full[ms]))
    return rt, full


def spawn_ok(fn, world: int, *args) -> list:
    """`spawn`, asserting that every rank returned: each rank's result."""
    results = spawn(fn, world, *args)
    for r, res in enumerate(results):
        assert res is not None and res[0] == "ok", f"rank {r}: {res}"
    return [res[1] for res in results]


def single_process_control():
    """A gloo group for a one-process test (world size 1; the default group is created
    on first use): the control group the executor agrees over, with no peer."""
    if not dist.is_initialized():
        store = dist.TCPStore(rank_rendezvous.HOST, 0, 1, is_master=True, wait_for_workers=False)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    return dist.new_group(backend="gloo")


# the ranks fork from a server that imported these once per test process ("forkserver"):
# under "spawn" every rank imported torch (and transformers for the interop tests) itself,
# seconds each on 2 cores (the suite: 720 s -> 455 s with the file-wise scheduling of
# conftest.py). A forked rank gets the server's environment: _worker restores the test's.
PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor.parallel",
           "transformers.models.llama.modeling_llama", "transformers.models.qwen2.modeling_qwen2",
           "transformers.models.qwen3.modeling_qwen3", "transformers.models.qwen3_moe.modeling_qwen3_moe"]


def _worker(rank, world, chan, fn, args, folder, environ):
    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(1)
    rank_rendezvous.init_group("gloo", rank, world, chan)
    try:
        result = ("ok", fn(rank, world, *args))
    except BaseException as error:  # noqa: BLE001 - reported to the parent test
        result = ("error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}")
    finally:
        dist.destroy_process_group()
    with open(os.path.join(folder, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def spawn(fn, world: int, *args) -> list:
    """Run fn(rank, world, *args) on `world` gloo processes; return each rank's result.
    A rank that raised returns ("error", text); the test decides what that means."""
    with tempfile.TemporaryDirectory() as folder:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        chan = rank_rendezvous.channel(ctx)
        mp.start_processes(_worker, args=(world, chan, fn, args, folder, dict(os.environ)), nprocs=world,
                           start_method="forkserver", join=True)
        out = []
        for r in range(world):
            path = os.path.join(folder, f"{r}.pkl")
            out.append(pickle.load(open(path, "rb")) if os.path.exists(path) else None)
        return out

"""Small modules and a gloo launcher for the weight-sync tests and benchmark (no vLLM).

`sync_test_module(training, generation, ...)` builds a module with an actor trained in
one layout and generating in another: each layout is (dp, tp, pp, gpus)."""

from __future__ import annotations

import os
import pickle
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# the ranks' rendezvous (tests/runtime/rank_rendezvous.py: rank 0 binds the store's port)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "runtime"))
import rank_rendezvous  # noqa: E402

from nereus.ir.model import Cluster, GpuSpec, Model, ModelStage, Module, Placement, Plan, Workload


def sync_test_module(training: tuple, generation: tuple, *, gpus: int = 4, layers: int = 2, hidden: int = 64,
                     heads: int = 4, kv_heads: int = 2, ffn: int = 128, vocab: int = 64,
                     dtype: str = "fp32", gpus_per_node: int = 0, more_plans: dict = None) -> Module:
    """An actor with actor.generation and actor.training placed as given, in plan "P"
    (and in each plan of `more_plans`: {name: (training, generation)})."""
    actor = Model("actor", "llama", layers, hidden, heads, kv_heads, ffn, vocab, dtype)
    workload = Workload("rl", 8, 8, 8, 1, (("generation", ("actor",)), ("training", ("actor",))))
    per_node = gpus_per_node or gpus
    cluster = Cluster("cpu", gpus // per_node, per_node, GpuSpec(64 << 30, 1e12, 1e11), 1e10, 1e9, 1 << 36)
    plans = []
    for name, (train, gen) in {"P": (training, generation), **(more_plans or {})}.items():
        placements = tuple(Placement(ModelStage("actor", stage), dp, tp, pp, tuple(ids), ())
                           for stage, (dp, tp, pp, ids) in (("generation", gen), ("training", train)))
        plans.append(Plan(name, None, placements, placements))
    return Module(cluster, (actor,), workload, tuple(plans), ())


def _entry(rank: int, world: int, chan, fn, args, out_dir: str) -> None:
    torch.set_num_threads(1)
    rank_rendezvous.init_group("gloo", rank, world, chan)
    try:
        result = ("ok", fn(rank, world, *args))
    except BaseException:  # noqa: BLE001 - report any failure to the parent
        result = ("error", traceback.format_exc())
    with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    dist.destroy_process_group()


def launch(fn, world: int, *args) -> list:
    """Run fn(rank, world, *args) in `world` gloo processes; their return values by rank."""
    with tempfile.TemporaryDirectory() as out_dir:
        chan = rank_rendezvous.channel(mp.get_context("spawn"))
        mp.start_processes(_entry, args=(world, chan, fn, args, out_dir), nprocs=world,
                           join=True, start_method="spawn")
        results = []
        for rank in range(world):
            with open(os.path.join(out_dir, f"{rank}.pkl"), "rb") as f:
                status, value = pickle.load(f)
            if status != "ok":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results.append(value)
        return results

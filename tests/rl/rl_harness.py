"""Run a function on N gloo processes and return rank 0's result.

Forked where torch sees no GPU: forking (not spawning) skips re-importing torch in every
child, which is most of the start-up cost on two shared cores. The parent must not have
run torch ops that start OpenMP threads before forking; the tests only build IR objects in
the parent. Spawned where torch sees a GPU: a forked child can use neither CUDA once the
parent (another test in the same pytest worker) started it ("CUDA error: initialization
error") nor autograd once the parent's backward started its device threads ("Unable to
handle autograd's threading in combination with fork-based multiprocessing"); both seen on
the H200 image. `fn` and its arguments are then pickled: module-level functions only.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import tempfile
import traceback

# the ranks' rendezvous (tests/runtime/rank_rendezvous.py: rank 0 binds the store's port)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "runtime"))
import rank_rendezvous  # noqa: E402


def _child(rank, world, chan, fn, args, queue):
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        rank_rendezvous.init_group("gloo", rank, world, chan)
        result = fn(*args)
        dist.barrier()
        dist.destroy_process_group()
        queue.put((rank, "ok", result if rank == 0 else None))
    except BaseException:  # report every failure to the parent, which raises it
        queue.put((rank, "error", traceback.format_exc()))


def run_world(world: int, fn, *args, timeout: float = 240.0):
    """fn(*args) on `world` gloo ranks; returns rank 0's return value."""
    import torch

    ctx = mp.get_context("spawn" if torch.cuda.is_available() else "fork")
    queue = ctx.Queue()
    chan = rank_rendezvous.channel(ctx)
    procs = [ctx.Process(target=_child, args=(r, world, chan, fn, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in range(world):
            rank, status, value = queue.get(timeout=timeout)
            if status == "error":
                errors.append(f"rank {rank}:\n{value}")
                break
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return results[0]


def tmpdir() -> str:
    return tempfile.mkdtemp(prefix="nereus-rl-")

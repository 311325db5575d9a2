"""Run a function on N forked gloo processes and return rank 0's result.

Forking (not spawning) skips re-importing torch in every child, which is most of the
start-up cost on two shared cores. The parent must not have run torch ops that start
OpenMP threads before forking; the tests only build IR objects in the parent.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import tempfile
import traceback


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank, world, port, fn, args, queue):
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        result = fn(*args)
        dist.barrier()
        dist.destroy_process_group()
        queue.put((rank, "ok", result if rank == 0 else None))
    except BaseException:  # report every failure to the parent, which raises it
        queue.put((rank, "error", traceback.format_exc()))


def run_world(world: int, fn, *args, timeout: float = 240.0):
    """fn(*args) on `world` gloo ranks; returns rank 0's return value."""
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_child, args=(r, world, port, fn, args, queue)) for r in range(world)]
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

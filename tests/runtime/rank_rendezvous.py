"""How the ranks of one multi-process test find each other, without a port race.

Choosing a free port in the parent (bind to port 0, read it, close) and letting rank 0
bind it seconds later, once its process has started and imported torch, leaves a window
in which another process can take that port: with two pytest workers, every gloo
connection of the other worker's tests takes an ephemeral port. CI lost a run to it
(EADDRINUSE at rank 0's TCPStore). Here rank 0 binds port 0 itself, so the kernel picks
a port that is free at that moment and it is held from then on, and then publishes the
number to the other ranks through a shared value. As with `init_method="env://"`, rank 0
owns the store: when it dies, the other ranks lose the store as before.

`channel(ctx)` in the parent (ctx: the multiprocessing context the ranks start from),
passed to every rank; `init_group(backend, rank, world, channel)` in each rank.
"""

from __future__ import annotations

HOST = "127.0.0.1"


def channel(ctx):
    """A port value and a ready event from `ctx`, for the ranks of one group."""
    return ctx.Value("i", 0), ctx.Event()


def init_group(backend: str, rank: int, world: int, chan, wait_s: float = 120.0, **options) -> None:
    """dist.init_process_group(backend, ...) over a TCPStore that rank 0 serves on a port
    the kernel picked for it; the other ranks wait up to `wait_s` for that port. The store's
    timeout is the group's, as with env:// (`options["timeout"]`, else torch's default)."""
    import torch.distributed as dist
    from torch.distributed.constants import default_pg_timeout

    timeout = options.get("timeout", default_pg_timeout)
    port, ready = chan
    if rank == 0:
        store = dist.TCPStore(HOST, 0, world, is_master=True, wait_for_workers=False, timeout=timeout)
        port.value = store.port
        ready.set()
    else:
        if not ready.wait(wait_s):
            raise TimeoutError(f"rank {rank}: rank 0 published no store port within {wait_s:.0f} s")
        store = dist.TCPStore(HOST, port.value, world, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, **options)

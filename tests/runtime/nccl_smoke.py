"""NCCL smoke run of the runtime on CUDA tensors (not collected by pytest: needs 2 GPUs).

    PYTHONPATH=. python tests/runtime/nccl_smoke.py      # on a machine with >= 2 GPUs

Two ranks, one GPU each, NCCL for the data and gloo for control; a chain of plan changes
of a small GQA llama (TP 2→1→2 via PP and DP), with verify on and small pieces packed
(the Triton pack kernels run on CUDA), every shard checked byte for byte on the GPU; the
chain runs with each rollback mode ("auto", "host": parking on the side stream, "device"),
with an injected fault in the middle of each (the old state must come back intact), the
last transition of each after `prepare()`.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import rank_rendezvous

SOURCE = """
cluster two { nodes 1 gpus_per_node 2 gpu { mem 80GB flops 989TFLOPS hbm 4.8TB/s } intra 900GB/s inter 25GB/s host_mem 1TB }
model actor = llama { layers 4 hidden 256 heads 8 kv_heads 2 ffn 512 vocab 1024 }
workload w { batch 4 prompt 16 response 16 microbatch 1  training: actor }
plan A { actor.training dp 1 tp 2      on 0, 1 }
plan B { actor.training dp 1 tp 1 pp 2 on 1, 0 }
plan C { actor.training dp 2 tp 1      on 0, 1 }
plan D { actor.training dp 1 tp 2      on 1, 0 }
"""


def _worker(rank: int, world: int, chan) -> None:
    torch.cuda.set_device(rank)
    rank_rendezvous.init_group("nccl", rank, world, chan, device_id=torch.device("cuda", rank))
    import nereus.ir as ir
    from nereus.runtime import Runtime, TransitionAborted
    from nereus.runtime.state import shard_of

    rt = Runtime(ir.parse_source(SOURCE, "two.nir"), "A", verify=True, direct_min_bytes=64 * 1024)
    gen = torch.Generator().manual_seed(0)
    full = {n: (torch.randn(s, generator=gen).to(d) if s else torch.tensor(3)) for n, (s, d) in
            rt.tensor_specs("actor.training").items()}
    rt.register("actor.training", rt.shard_state_dict("actor.training", full))
    def check() -> bool:
        local = rt.state("actor.training")
        unit = next(u for u in rt.layout("actor.training") if rank in u["gpus"])
        good = int(local["actor/#step"]) == 3
        for s in unit["shards"]:
            if s["gpu"] == rank:
                got = local[s["tensor"]]
                good &= bool(got.is_cuda and torch.equal(got.cpu(), shard_of(full[s["tensor"]], s["boxes"])))
        return good

    ok = True
    for mode in ("auto", "host", "device"):
        rt.rollback = mode
        for k, target in enumerate(("B", "C", "D", "A")):
            if k == 1:  # an injected fault: every rank keeps its old state
                try:
                    rt.transition(target, fault=(1, 0, "pack"))
                    ok = False
                except TransitionAborted:
                    ok &= check()
            if k == 3:
                rt.prepare(target)
            report = rt.transition(target)
            ok &= check()
            print(f"rank {rank} {mode} -> {target}: {report.max_seconds * 1e3:.1f} ms, sent {report.bytes_sent} B, "
                  f"parked {report.parked_bytes} B, held {report.held_bytes} B, prepared {report.prepared}, "
                  f"verified {report.verified}, pack backend {report.pack_backend}, ok {ok}", flush=True)
    dist.destroy_process_group()
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    mp.start_processes(_worker, args=(2, rank_rendezvous.channel(mp.get_context("spawn"))), nprocs=2,
                       start_method="spawn")
    print("nccl smoke: ok")

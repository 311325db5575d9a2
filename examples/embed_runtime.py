"""Embedding the Nereus runtime in training code: hold the live state in Nereus and
change the parallel layout in place, without a checkpoint.

    torchrun --nproc-per-node 4 examples/embed_runtime.py         # CPU, gloo
    PYTHONPATH=. python examples/embed_runtime.py                  # launches 4 gloo ranks itself

The plan file is written below (a tiny GQA llama actor and critic on 4 "GPUs"); rank r
drives GPU r. Each rank starts from an HF-style state dict, keeps only its shards, takes
a fake optimizer step on them, moves to plan S2 (actor TP 2→4, critic PP 1→2) and checks
that the gathered state is the one it had before the move.
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist

PLAN = """
cluster cpu { nodes 1 gpus_per_node 4 gpu { mem 1GB flops 1TFLOPS hbm 100GB/s } intra 10GB/s inter 1GB/s host_mem 8GB }
model actor  = llama { layers 2 hidden 64 heads 4 kv_heads 2 ffn 128 vocab 256 }
model critic = actor { head value }
workload ppo {
  batch 4 prompt 16 response 16 microbatch 1
  generation: actor
  training:   actor, critic
}
plan S1 {
  actor.generation dp 2 tp 2      on 0..3
  actor.training   dp 1 tp 2      on 0, 1
  critic.training  dp 1 tp 2      on 2, 3
}
plan S2 = S1 {
  actor.training   dp 1 tp 4      on 0..3
  critic.training  dp 1 tp 2 pp 2 on 0..3
}
"""


def full_state(rt, model_stage: str) -> dict:
    """What a training job would load from its HF checkpoint, plus fresh Adam state."""
    from nereus.runtime.naming import hf_targets, hf_to_nereus

    model = rt.module.model(model_stage.split(".")[0])
    gen = torch.Generator().manual_seed(0)
    hf = {name: torch.randn(t.shape, generator=gen) for name, t in hf_targets(model).items()}  # "from_pretrained"
    weights = {k: v.to(torch.bfloat16) for k, v in hf_to_nereus(model, hf).items()}
    full = {}
    for name, (shape, dtype) in rt.tensor_specs(model_stage).items():
        if name in weights:
            full[name] = weights[name]
        elif name.endswith("#master"):
            full[name] = weights[name.split("#")[0]].float()
        elif name.endswith("#step"):
            full[name] = torch.tensor(0)
        else:
            full[name] = torch.zeros(shape, dtype=dtype)
    return full


def main() -> None:
    import nereus.runtime as nr

    path = os.path.join(tempfile.gettempdir(), "nereus-embed-example.nir")
    if int(os.environ.get("RANK", "0")) == 0:
        with open(path, "w") as f:
            f.write(PLAN)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    dist.barrier()
    rt = nr.Runtime.from_file(path, plan="S1")
    stages = ("actor.generation", "actor.training", "critic.training")
    for ms in stages:
        rt.register(ms, rt.shard_state_dict(ms, full_state(rt, ms)))

    # a training step on the local shards (stands in for forward/backward/Adam)
    local = rt.state("actor.training")
    for name, tensor in local.items():
        if name.endswith("#exp_avg"):
            tensor.add_(1.0)
    if local:
        local["actor/#step"] += 1
        rt.register("actor.training", local)
    before = rt.gather_state_dict("actor.training")

    report = rt.transition("S2")  # collective: every rank calls it
    after = rt.gather_state_dict("actor.training")
    same = all(torch.equal(before[k], after[k]) for k in before)
    if rt.rank == 0:
        print(f"S1 -> S2: {report.max_seconds * 1e3:.1f} ms, {report.total_bytes_sent} bytes sent, "
              f"{len(report.rounds)} round(s); actor state unchanged by the move: {same}")
    shards = {ms: len(rt.state(ms)) for ms in stages}
    print(f"rank {rt.rank}: shards held now {shards}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _spawned(rank: int, world: int, store_file: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    # a file store: the ranks of one machine meet without a port (one chosen up front
    # could be taken by another process before rank 0 binds it)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world)
    main()


if __name__ == "__main__":
    if "RANK" in os.environ:  # under torchrun
        main()
    else:
        import torch.multiprocessing as mp

        with tempfile.TemporaryDirectory() as folder:
            mp.start_processes(_spawned, args=(4, os.path.join(folder, "store")), nprocs=4, start_method="spawn")

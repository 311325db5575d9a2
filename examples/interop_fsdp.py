"""Bring your own model: a transformers Llama trained under PyTorch's own parallelism,
moved between layouts by Nereus (docs/interop.md).

    torchrun --standalone --nproc-per-node 4 examples/interop_fsdp.py          # CPU, gloo
    torchrun --standalone --nproc-per-node 4 examples/interop_fsdp.py --cuda   # one GPU per rank, NCCL

FSDP2 dp 2 x TP 2  --train 2 steps-->  TP 4  --train 2-->  FSDP 4  --train 2-->
Each move is `reshard_module(src, src_optim, dst, dst_optim)`: the destination is built on
the meta device and parallelized for the new layout; Nereus fills its parameters, buffers
and AdamW state. A control run trains the same 6 steps without moving; the losses must
agree (within 1e-5 relative), and the state after each move equals the state before it
bit for bit.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

SIZES = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, max_position_embeddings=128)


def build(layout: str, device: str, meta: bool = True):
    """A LlamaForCausalLM parallelized as `layout` ("fsdp2_tp2", "tp4" or "fsdp4")."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device("meta" if meta else device):
        model = LlamaForCausalLM(LlamaConfig(**SIZES))
    tp_plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
               "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
               "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
               "mlp.down_proj": RowwiseParallel()}
    if layout == "fsdp2_tp2":
        mesh = init_device_mesh(device, (2, 2), mesh_dim_names=("dp", "tp"))
        for layer in model.model.layers:
            parallelize_module(layer, mesh["tp"], tp_plan)
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    elif layout == "tp4":
        mesh = init_device_mesh(device, (4,), mesh_dim_names=("tp",))
        for layer in model.model.layers:
            parallelize_module(layer, mesh, tp_plan)
    else:
        mesh = init_device_mesh(device, (4,), mesh_dim_names=("dp",))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def train(model, optim, steps, device: str) -> list[float]:
    losses = []
    for step in steps:
        ids = torch.randint(0, SIZES["vocab_size"], (4, 16), generator=torch.Generator().manual_seed(step))
        ids = ids.to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def main() -> None:
    from nereus.interop import reshard_module

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cuda", action="store_true", help="one GPU per rank, NCCL (default: CPU, gloo)")
    args = parser.parse_args()
    device = "cuda" if args.cuda else "cpu"
    if args.cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if args.cuda else "gloo")
    if dist.get_world_size() != 4:
        raise SystemExit("run with torchrun --standalone --nproc-per-node 4")
    rank = dist.get_rank()

    # the control: 6 steps in one layout
    control = build("fsdp2_tp2", device, meta=False)
    control_optim = torch.optim.AdamW(control.parameters(), lr=1e-3)
    expected = train(control, control_optim, range(6), device)
    del control, control_optim

    model = build("fsdp2_tp2", device, meta=False)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = train(model, optim, range(2), device)
    for i, layout in enumerate(("tp4", "fsdp4")):
        dst = build(layout, device)
        dst_optim = torch.optim.AdamW(dst.parameters(), lr=1e-3)
        report = reshard_module(model, optim, dst, dst_optim)
        if rank == 0:
            print(f"-> {layout}: {report.max_seconds * 1e3:.1f} ms, {report.bytes_sent / 2**10:.1f} KiB sent "
                  f"(owner-change bound {report.lower_bound_bytes / 2**10:.1f} KiB), {report.rounds} round(s), "
                  f"proven {report.verified}, whole call {report.wall_s:.2f} s", flush=True)
        model, optim = dst, dst_optim
        losses += train(model, optim, range(2 + 2 * i, 4 + 2 * i), device)
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, expected))
    if rank == 0:
        print("losses   ", " ".join(f"{x:.6f}" for x in losses))
        print("control  ", " ".join(f"{x:.6f}" for x in expected))
        print(f"largest relative difference {worst:.2e}")
    dist.destroy_process_group()
    if worst > 1e-5:
        raise SystemExit(f"losses differ from the control by {worst:.2e}")


if __name__ == "__main__":
    main()

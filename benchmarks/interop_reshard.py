"""nereus.interop.reshard_module against what a PyTorch user does today, on a
transformers Llama under FSDP2 / TP / both.

    PYTHONPATH=. python benchmarks/interop_reshard.py                  # CPU, 4 gloo ranks (CI size)
    PYTHONPATH=. python benchmarks/interop_reshard.py --cuda --world 2 --preset 8b-layers 4
    PYTHONPATH=. python benchmarks/interop_reshard.py --pairs fsdp2_tp2:tp4,tp4:fsdp4

Layouts (interop_cases' five, on `--world` ranks W): replicated (plain tensors), fsdpW,
tpW, fsdp2_tpW/2 (mesh (dp, tp)) and tpW/2_fsdp2 (mesh (tp, dp)) — the last two need an
even world. The model: a LlamaForCausalLM (`--preset tiny|small|8b-layers`, `--layers`),
bf16 or fp32 (`--dtype`), AdamW state after one training step (fp32 AdamW state with
`--dtype fp32`; AdamW keeps states in the parameter's dtype). For every ordered pair of
layouts, three ways to get the source's parameters and optimizer state into a
destination built on the meta device and parallelized for the target:

- nereus: `reshard_module(src, src_optim, dst, dst_optim)`;
- dcp: torch.distributed.checkpoint save of `get_state_dict(src, src_optim)` and load into
  the destination's (`to_empty`, `get_state_dict`, `dcp.load`, `set_state_dict`), the
  checkpoint in /dev/shm when it exists (the fastest storage a user has);
- redistribute: per parameter and state, `redistribute` where source and destination
  share a mesh, else `full_tensor()` + `distribute_tensor(..., src_data_rank=None)` (each
  rank slices its part of the gathered tensor), copied into the destination.

Every side is timed the same way: a fresh destination per run (built on meta and
parallelized outside the timed region; its materialization and optimizer inside, after
`to_empty` for dcp and redistribute, as a user must build it there), a barrier (and device synchronize) at both ends, the slowest rank's time; the
first run is cold, then `--repeats` warm runs whose median is reported. Bytes: nereus's
bytes sent; the owner-change bound (bytes of new shards their rank did not hold); dcp's
bytes written and read; redistribute's bytes received by all-gathers. Every method's
result is checked against the source (full tensors, bit for bit) once per pair. The
last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PRESETS = {
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4),
    "small": dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_attention_heads=8,
                  num_key_value_heads=8),
    "8b-layers": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                      num_key_value_heads=8),
}
TP_PLAN = {"self_attn.q_proj": "col", "self_attn.k_proj": "col", "self_attn.v_proj": "col", "self_attn.o_proj": "row",
           "mlp.gate_proj": "col", "mlp.up_proj": "col", "mlp.down_proj": "row"}


def layouts(world: int) -> list[str]:
    out = ["replicated", f"fsdp{world}", f"tp{world}"]
    if world % 2 == 0 and world >= 4:
        out += [f"fsdp2_tp{world // 2}", f"tp{world // 2}_fsdp2"]
    return out


def build(layout: str, args, device: str, meta: bool):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**PRESETS[args.preset], num_hidden_layers=args.layers, max_position_embeddings=256)
    torch.manual_seed(0)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    with torch.device("meta" if meta else device):
        model = LlamaForCausalLM(config).to(dtype)
    world = dist.get_world_size()
    plan = {k: ColwiseParallel() if v == "col" else RowwiseParallel() for k, v in TP_PLAN.items()}
    if layout == "replicated":
        return model
    if layout.startswith("fsdp") and "_" not in layout:
        mesh = init_device_mesh(device, (world,), mesh_dim_names=("dp",))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout.startswith("tp") and "_" not in layout:
        mesh = init_device_mesh(device, (world,), mesh_dim_names=("tp",))
        for layer in model.model.layers:
            parallelize_module(layer, mesh, plan)
    else:
        names = ("dp", "tp") if layout.startswith("fsdp") else ("tp", "dp")
        shape = (2, world // 2) if names[0] == "dp" else (world // 2, 2)
        mesh = init_device_mesh(device, shape, mesh_dim_names=names)
        for layer in model.model.layers:
            parallelize_module(layer, mesh["tp"], plan)
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    return model


def optimizer(model):
    # foreach=False on every side: a TP layout leaves norms and embeddings plain tensors
    # beside DTensors, and CUDA's default foreach Adam refuses the mix (DCP's get_state_dict
    # steps the fresh optimizer once; seen on an H100, torch 2.11)
    return torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)


def train_step(model, optim, device: str) -> None:
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0)).to(device)
    model(input_ids=ids, labels=ids).loss.backward()
    optim.step()
    optim.zero_grad()


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def same_state(a, a_optim, b, b_optim) -> bool:
    """Every parameter, buffer and optimizer state equal, as full tensors (collective)."""
    ok = True
    pb = dict(b.named_parameters())
    for name, p in a.named_parameters():
        ok &= torch.equal(_full(p).detach(), _full(pb[name]).detach())
        sa, sb = a_optim.state.get(p, {}), b_optim.state.get(pb[name], {})
        for key, value in sa.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                ok &= torch.equal(_full(value), _full(sb[key]))
            elif isinstance(value, torch.Tensor):
                ok &= float(value) == float(sb[key])
    bb = dict(b.named_buffers())
    for name, buf in a.named_buffers():
        ok &= torch.equal(_full(buf), _full(bb[name]))
    flag = torch.tensor([int(ok)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=_gloo())
    return bool(flag.item())


_GLOO: list = []


def _gloo():
    if dist.get_backend() == "gloo":
        return None
    if not _GLOO:
        _GLOO.append(dist.new_group(backend="gloo"))
    return _GLOO[0]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
    dist.barrier(group=_gloo())


def nereus_move(src, src_optim, dst, device, scratch) -> tuple:
    from nereus.interop import reshard_module

    dst_optim = optimizer(dst)  # over the meta module: reshard_module materializes it
    report = reshard_module(src, src_optim, dst, dst_optim)
    return dst_optim, {"bytes": report.bytes_sent, "bound": report.lower_bound_bytes, "compile_s": report.compile_s}


def dcp_move(src, src_optim, dst, device, scratch) -> tuple:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    folder = os.path.join(scratch, "ckpt")
    if dist.get_rank() == 0:
        shutil.rmtree(folder, ignore_errors=True)
    dist.barrier(group=_gloo())
    model_sd, optim_sd = get_state_dict(src, src_optim)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder)
    dst.to_empty(device=device)
    dst_optim = optimizer(dst)  # after to_empty: it holds the materialized parameters
    model_sd, optim_sd = get_state_dict(dst, dst_optim)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(dst, dst_optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    with torch.no_grad():  # plain buffers (rotary inv_freq) are not in a state dict after to_empty
        src_buffers = dict(src.named_buffers())
        for name, buf in dst.named_buffers():
            buf.copy_(_full(src_buffers[name]))
    written = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)) if dist.get_rank() == 0 else 0
    return dst_optim, {"bytes": 2 * written}


def redistribute_move(src, src_optim, dst, device, scratch) -> tuple:
    from torch.distributed.tensor import DTensor, distribute_tensor

    dst.to_empty(device=device)
    dst_optim = optimizer(dst)
    received = 0
    world = dist.get_world_size()

    def move(value, like):
        nonlocal received
        if isinstance(value, DTensor) and isinstance(like, DTensor) and value.device_mesh == like.device_mesh:
            return value.redistribute(like.device_mesh, like.placements)
        full = _full(value)
        if isinstance(value, DTensor):
            received += full.numel() * full.element_size() * (world - 1) // world
        if isinstance(like, DTensor):
            return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)
        return full

    dp = dict(dst.named_parameters())
    with torch.no_grad():
        for name, p in src.named_parameters():
            q = dp[name]
            new = move(p.detach(), q)
            (q.to_local() if isinstance(q, DTensor) else q).copy_(new.to_local() if isinstance(new, DTensor) else new)
            state = {}
            for key, value in src_optim.state.get(p, {}).items():
                state[key] = move(value, q) if isinstance(value, torch.Tensor) and value.dim() > 0 else value.clone()
            dst_optim.state[q] = state
        src_buffers = dict(src.named_buffers())
        for name, buf in dst.named_buffers():
            buf.copy_(_full(src_buffers[name]))
    for a, b in zip(src_optim.param_groups, dst_optim.param_groups):
        b.update({k: v for k, v in a.items() if k != "params"})
    return dst_optim, {"bytes": received}


METHODS = {"nereus": nereus_move, "dcp": dcp_move, "redistribute": redistribute_move}


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_gloo())
    return float(t.item())


def _worker(rank, world, args, folder, store_path):
    device = "cuda" if args.cuda else "cpu"
    if args.cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if args.cuda else "gloo", init_method=f"file://{store_path}", rank=rank,
                            world_size=world)
    scratch = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) if rank == 0 else ""
    shared: list = [scratch]
    dist.broadcast_object_list(shared, src=0, group=_gloo())
    scratch = shared[0]
    names = layouts(world)
    pairs = [tuple(p.split(":")) for p in args.pairs.split(",")] if args.pairs else \
        [(a, b) for a in names for b in names if a != b]
    results = []
    for source, target in pairs:
        src = build(source, args, device, meta=False)
        src_optim = optimizer(src)
        train_step(src, src_optim, device)
        row = {"source": source, "target": target}
        for method, move in METHODS.items():
            times, extra, ok = [], {}, None
            for run in range(1 + args.repeats):
                dst = build(target, args, device, meta=True)
                _sync(device)
                started = time.perf_counter()
                dst_optim, extra = move(src, src_optim, dst, device, scratch)
                _sync(device)
                times.append(_slowest(time.perf_counter() - started))
                if run == 0:
                    ok = same_state(src, src_optim, dst, dst_optim)
                del dst, dst_optim
            row[f"{method}_cold_s"] = times[0]
            row[f"{method}_s"] = statistics.median(times[1:]) if len(times) > 1 else times[0]
            row[f"{method}_verified"] = ok
            total = torch.tensor([extra.get("bytes", 0)], dtype=torch.int64)
            if method != "nereus":
                dist.all_reduce(total, group=_gloo())
            row[f"{method}_bytes"] = int(total.item())
            if method == "nereus":
                row["owner_change_bound_bytes"] = extra["bound"]
        row["ratio_dcp"] = row["dcp_s"] / row["nereus_s"]
        row["ratio_redistribute"] = row["redistribute_s"] / row["nereus_s"]
        results.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
        del src, src_optim
    if rank == 0:
        shutil.rmtree(scratch, ignore_errors=True)
        with open(os.path.join(folder, "results.json"), "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4, help="ranks (default 4)")
    parser.add_argument("--cuda", action="store_true", help="one GPU per rank, NCCL")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--repeats", type=int, default=3, help="warm runs per method and pair (median)")
    parser.add_argument("--pairs", default="", help="source:target,... (default: every ordered pair)")
    parser.add_argument("--out", help="write the JSON here too")
    args = parser.parse_args(argv)
    if args.cuda and torch.cuda.device_count() < args.world:
        parser.error(f"--cuda needs {args.world} GPUs, this host has {torch.cuda.device_count()}")
    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(_worker, args=(args.world, args, folder, os.path.join(folder, "store")),
                           nprocs=args.world, start_method="spawn", join=True)
        with open(os.path.join(folder, "results.json")) as f:
            rows = json.load(f)
    summary = {
        "benchmark": "interop_reshard", "world": args.world, "device": "cuda" if args.cuda else "cpu",
        "preset": args.preset, "layers": args.layers, "dtype": args.dtype, "repeats": args.repeats,
        "pairs": rows,
        "all_verified": all(r[f"{m}_verified"] for r in rows for m in METHODS),
        "min_ratio_dcp": min(r["ratio_dcp"] for r in rows),
        "min_ratio_redistribute": min(r["ratio_redistribute"] for r in rows),
        "sent_within_bound": all(r["nereus_bytes"] <= r["owner_change_bound_bytes"] for r in rows),
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    sys.exit(0 if main()["all_verified"] else 1)

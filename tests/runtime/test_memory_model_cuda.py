"""The memory model measured on a GPU (CUDA only; the 2-GPU test also needs 2 GPUs).

One GPU: for every rank of programs that stage (two models trading GPUs on full GPUs),
move state into and out of offloaded memory, and have odd-sized segments, each round's
message buffers are allocated on the GPU as the executor allocates them (`outgoing`,
`incoming`, `planned_streams`: host pieces copied up whole, bounce tensors, ring slots),
with the shards each rank would hold in host memory in pinned host memory. The device
memory this allocates is exactly those tensors (the requested sizes of the round's new
blocks in torch's memory snapshot; a block may hold up to 1 MiB more that the caching
allocator does not split off a cached block, which the plan's `reserve` covers), their
bytes are what the runtime accounts
(`wires.round_buffer_bytes`) and at most what the program's cuda model proves for that
rank and round. No NCCL: nothing is sent.

Two GPUs: the staging plan's rank programs run over NCCL (rollback="host", so device
memory follows the program), after a first run of each; each rank's
torch.cuda.max_memory_allocated() above its start stays within the proven growth of its
GPU (verifier peak minus its bytes before round 0) for the cuda-model program, and
exceeds it for the cpu-model program of the same plan (the bug the model fixes). What
the run leaves allocated beyond the new state (tables the pack kernels keep with their
plans) is allowed for.

    PYTHONPATH=. python -m pytest -q tests/runtime/test_memory_model_cuda.py

writes the figures to $OUT/memory_model_cuda.json when OUT is set.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import nereus.ir as ir
from nereus.passes.verify import verify_program

import rank_rendezvous
from memory_cases import case_programs, host_units, model_round_buffers

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# two models (hidden 512) trading GPUs of 120 MB (each unit ~91 MiB with Adam state):
# the cycle is broken by staging, and the sends out of the staged shards are cut to fit
# (11 rounds); every tensor and piece a multiple of 512 bytes (no allocator rounding)
GPU_SWAP = """
cluster c { nodes 1 gpus_per_node 2 gpu { mem 120MB flops 1TFLOPS hbm 100GB/s } intra 100GB/s inter 10GB/s host_mem 64GB }
model actor = llama { layers 2 hidden 512 heads 8 kv_heads 4 ffn 1536 vocab 512 dtype bf16 }
model critic = actor
workload w { batch 1 prompt 1 response 1 microbatch 1 training: actor, critic }
plan A { actor.training dp 1 on 0  critic.training dp 1 on 1 }
plan B { actor.training dp 1 on 1  critic.training dp 1 on 0 }
"""
FIGURES: dict = {}


def _programs(memory_model: str = "cuda") -> dict:
    return case_programs(memory_model, ir.parse_source(GPU_SWAP, "swap.nir"))


def _full(program: dict) -> dict:
    gen = torch.Generator().manual_seed(0)
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    return {t["name"]: torch.randn(t["shape"], generator=gen).to(dtypes[t["dtype"]]) for t in program["tensors"]}


# torch's caching allocator does not split a cached large-pool block when at most this
# much of it would remain: the tensor's block then carries the rest (seen on an H100: one
# round's block 1 MiB over its tensor's bytes); the plan's `reserve` covers it
UNSPLIT_SLACK = (1 << 20) + 511


def _active_blocks(device) -> dict:
    """{address: (size, requested bytes, where it was allocated)} of the allocator's
    active blocks (the place from torch's memory history, recorded by the one-GPU test)."""
    blocks = {}
    for segment in torch.cuda.memory_snapshot():
        if segment["device"] != device.index:
            continue
        for block in segment["blocks"]:
            if block["state"] == "active_allocated":
                frames = [f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}" for f in block.get("frames", ())
                          if f["filename"].endswith(".py")][:4]
                blocks[block["address"]] = (block["size"], block.get("requested_size", block["size"]), frames)
    return blocks


def _round_buffers_on_one_gpu(program: dict, rank: int, device, depth: int, chunk_bytes: int) -> list:
    """Per round with messages on `rank`: (round, measured bytes, the allocations' bytes,
    the runtime's accounting, the round's new blocks)."""
    from nereus.runtime import offload
    from nereus.runtime.execution_plan import build_plan
    from nereus.runtime.program import rank_program
    from nereus.runtime.state import shard_unit
    from nereus.runtime.wires import Live, allocate, incoming, outgoing, planned_streams, round_buffer_bytes

    prog = rank_program(program, rank)
    plan = build_plan(prog, chunk_bytes)
    host_before, host_after, staged = host_units(program)
    full = _full(program)
    before = {}
    for unit in program["units"]["before"]:
        if rank in unit["gpus"]:
            shards = shard_unit(unit, rank, full)
            before[unit["id"]] = {n: (offload.to_host(t, device) if unit["id"] in host_before else t.to(device))
                                  for n, t in shards.items()}
    new: dict = {}
    for unit in prog.after:  # every destination up front: only the buffers are measured
        allocate(prog, unit, new, Live(0), device, plan.aliased, frozenset(host_after))
    owned = {t.untyped_storage().data_ptr() for shards in list(before.values()) + list(new.values())
             for t in shards.values()}
    out = []
    for work, planned in zip(prog.rounds, plan.rounds):
        if not (work.sends or work.recvs):
            continue
        host = frozenset(host_before | staged[work.index])
        sources = {u: {n: offload.to_host(t, device) if u in host else t for n, t in shards.items()}
                   for u, shards in before.items()}
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        present = _active_blocks(device)
        sends = [outgoing(m, sources, device, f, r, host) for m, f, r in
                 zip(work.sends, planned.send_in_stream, planned.send_regions)]
        recvs = [incoming(m, prog, new, Live(0), device, f, r, frozenset(host_after)) for m, f, r in
                 zip(work.recvs, planned.recv_in_stream, planned.recv_regions)]
        streams_ = planned_streams(planned.send_streams, lambda p, name: sources[p.src_unit][name], device, depth)
        streams_ += planned_streams(planned.recv_streams, lambda p, name: new[p.dst_unit][name], device, depth)
        torch.cuda.synchronize(device)
        measured = torch.cuda.memory_allocated(device) - base
        sizes = [s.numel() for stream in streams_ for s in stream.slots]
        sizes += [t.numel() * t.element_size() for w in sends for t in w.direct
                  if t.untyped_storage().data_ptr() not in owned]  # host pieces copied up
        sizes += [b.numel() * b.element_size() for w in recvs for b, _ in w.bounce]
        accounted = round_buffer_bytes(planned, work, depth, host, frozenset(host_after))
        blocks = [b for a, b in _active_blocks(device).items() if a not in present]
        assert sum(b[0] for b in blocks) == measured, "the snapshot and memory_allocated disagree"
        out.append((work.index, measured, sorted(n for n in sizes if n), accounted, blocks))
        del sends, recvs, streams_, sources
    return out


@pytest.mark.parametrize("chunk_bytes, depth", [(128 << 20, 8), (64 << 10, 2)], ids=["defaults", "64KiB-chunks-depth-2"])
def test_the_buffers_one_gpu_allocates_are_the_accounted_ones_within_the_proof(chunk_bytes, depth):
    device = torch.device("cuda", torch.cuda.current_device())
    seen = []
    torch.cuda.memory._record_memory_history(max_entries=100000)  # where an unexpected block came from
    try:
        rounds = {(name, rank): _round_buffers_on_one_gpu(program, rank, device, depth, chunk_bytes)
                  for name, program in _programs().items() for rank in (0, 1)}
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    for name, program in _programs().items():
        bound = model_round_buffers(program)
        for rank in (0, 1):
            for index, measured, allocated, accounted, blocks in rounds[(name, rank)]:
                where = (name, rank, index)
                # nothing else allocated: the round's new blocks are exactly its buffers' requests
                assert sorted(b[1] for b in blocks) == allocated, (where, blocks)
                assert all(b[0] - b[1] <= UNSPLIT_SLACK for b in blocks), (where, blocks)
                assert sum(allocated) == accounted, where  # the runtime counts what it allocates
                assert accounted <= bound.get((index, rank), 0), (where, accounted, bound.get((index, rank)))
                seen.append({"case": name, "rank": rank, "round": index, "measured": measured,
                             "accounted": accounted, "proven": bound.get((index, rank), 0),
                             "allocator_slack": measured - accounted})
    assert any(s["case"] == "swap" and s["measured"] > 0 for s in seen)
    FIGURES[f"one_gpu {chunk_bytes}x{depth}"] = seen
    _write()


def _start_bytes(program: dict, gpu: int) -> int:
    """Device bytes of `gpu` before round 0 as the verifier counts them."""
    sizes = {"bf16": 2, "fp32": 4}
    dtype = {t["name"]: t["dtype"] for t in program["tensors"]}
    total = int(program["resident_bytes"].get(str(gpu), 0))
    for unit in program["units"]["before"]:
        if unit.get("offload"):
            continue
        for shard in unit["shards"]:
            if shard["gpu"] == gpu:
                for box in shard["boxes"]:
                    n = sizes[dtype[shard["tensor"]]]
                    for lo, hi in box:
                        n *= hi - lo
                    total += n
    return total


def _device_bytes(shards: dict) -> int:
    return sum(t.numel() * t.element_size() for held in shards.values() for t in held.values() if t.device.type != "cpu")


def _two_gpu_worker(rank: int, world: int, chan, programs: dict, folder: str, backend: str = "nccl") -> None:
    """Each program's rank part on this rank's GPU (backend "gloo": on CPU, a dry run of
    this code with no memory figures)."""
    cuda = backend == "nccl"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(rank)
    rank_rendezvous.init_group(backend, rank, world, chan, **({"device_id": device} if cuda else {}))
    from nereus.runtime import offload
    from nereus.runtime.executor import execute
    from nereus.runtime.program import offloaded_units, rank_program
    from nereus.runtime.state import shard_unit

    control = dist.new_group(backend="gloo")
    allocated = (lambda: torch.cuda.memory_allocated(device)) if cuda else (lambda: 0)
    out = {}
    for warm in (True, False):  # a first run builds the pack kernels' plans; the second is measured
        for name, program in programs.items():
            full = _full(program)
            before = {u["id"]: {n: offload.to_host(t, device) if u.get("offload") else t.to(device)
                                for n, t in shard_unit(u, rank, full).items()}
                      for u in program["units"]["before"] if rank in u["gpus"]}
            held = _device_bytes(before)
            del full
            if cuda:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            base = allocated()
            result = execute(rank_program(program, rank), before, group=None, control=control, device=device,
                             rollback="host", offloaded=offloaded_units(program))
            if cuda:
                torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device) if cuda else 0
            state, end = _device_bytes(result.state), allocated()
            del result, before
            if not warm:
                # kept with the pack kernels' plans: allocated in the run, still there after it
                out[name] = {"growth": peak - base, "cached": max(0, end - (base - held + state))}
    with open(os.path.join(folder, f"{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


def _two_gpu_programs() -> dict:
    """The staging plan's programs for both models (its tensors and pieces are multiples
    of 512 bytes, so the allocator's rounding adds nothing to the measured peak)."""
    return {"cuda swap": _programs("cuda")["swap"], "cpu swap": _programs("cpu")["swap"]}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_on_two_gpus_the_real_peak_stays_within_the_proof_of_the_cuda_model(tmp_path):
    programs = _two_gpu_programs()
    mp.start_processes(_two_gpu_worker, args=(2, rank_rendezvous.channel(mp.get_context("spawn")), programs,
                                              str(tmp_path)), nprocs=2, start_method="spawn")
    per_rank = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    figures = {}
    for name, program in programs.items():
        report = verify_program(program)
        proven = [report.peak_bytes[r] - _start_bytes(program, r) for r in range(2)]
        for rank in range(2):
            figures[f"{name} rank {rank}"] = dict(per_rank[rank][name], proven_growth=proven[rank])
        got = [per_rank[r][name] for r in range(2)]
        if name.startswith("cuda"):
            assert all(g["growth"] <= p + g["cached"] for g, p in zip(got, proven)), (name, got, proven)
        else:  # the old model's proof leaves the source's buffers out
            assert any(g["growth"] > p + g["cached"] for g, p in zip(got, proven)), (name, got, proven)
    FIGURES["two_gpus"] = figures
    _write()


def _write() -> None:
    folder = os.environ.get("OUT")
    if folder:
        with open(os.path.join(folder, "memory_model_cuda.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), **FIGURES}, f, indent=1)

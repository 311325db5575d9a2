"""The runtime's accounting of a round's message buffers is what a GPU allocates, and the
memory model proves it (nereus.passes.memory_model, wires.round_buffer_bytes):

- per rank and round, the buffers the runtime counts (ring slots, pieces read from host
  memory copied to the device whole, bounce tensors of pieces written into it) never
  exceed what the program's model charges, for plans that stage (units trading places
  on full GPUs), move into and out of offloaded memory, and have odd-sized segments cut by
  small chunks; the old ("cpu") model charges less than these buffers where a send reads
  host memory;
- a chunk cuts a piece after a multiple of 8 bytes, so the parts of a piece take no more
  room in the ring than the piece (the old cut padded each part: over the bound by 8 bytes
  in the odd swap, 1 KiB chunks);
- the executor on 2 gloo ranks counts them so: its peak stays within the verifier's
  proof of the cuda-model program, and exceeds the proof of the cpu-model program of the
  same staging plan (the CPU run used to subtract exactly these bytes).

The measurement on a GPU is tests/runtime/test_memory_model_cuda.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from nereus.passes.verify import verify_program

from memory_cases import accounted_round_buffers, case_programs, model_round_buffers
from runtime_helpers import reference_state, spawn_ok


@pytest.mark.parametrize("chunk_bytes, depth", [(128 << 20, 8), (1 << 10, 2), (1 << 10, 1 << 12)],
                         ids=["defaults", "1KiB-chunks-depth-2", "1KiB-chunks-every-one-a-slot"])
def test_the_runtimes_round_buffers_stay_within_the_cuda_model(chunk_bytes, depth):
    for name, program in case_programs("cuda").items():
        bound = model_round_buffers(program)
        counted = accounted_round_buffers(program, depth, chunk_bytes)
        over = {key: (n, bound.get(key, 0)) for key, n in counted.items() if n > bound.get(key, 0)}
        assert counted and over == {}, (name, over)
        verify_program(program)  # and the cuda program is proven with them


def test_the_cpu_model_undercounts_sends_out_of_host_memory():
    programs = case_programs("cpu")
    for name in ("swap", "offload B->C"):  # a staged source, an offloaded one
        bound = model_round_buffers(programs[name])
        counted = accounted_round_buffers(programs[name], 8, 128 << 20)
        assert any(n > bound.get(key, 0) for key, n in counted.items()), (name, counted, bound)


@pytest.mark.parametrize("chunk_bytes", [1024, 1030, 4096])
def test_a_chunk_cuts_a_piece_after_a_multiple_of_8_bytes(chunk_bytes):
    """So a piece's parts take no more room in the ring than the piece: 6-byte rows, a
    1-D tensor of 2-byte rows, each cut by chunks of these sizes."""
    from nereus.passes.memory_model import packed
    from nereus.runtime import streams

    views = [torch.empty(1000, 3, dtype=torch.bfloat16, device="meta"), torch.empty(777, dtype=torch.bfloat16,
                                                                                    device="meta")]
    parts: dict = {}
    for chunk in streams.chunk_views(views, chunk_bytes, alone_bytes=0):
        for segment in chunk:
            index = next(i for i, v in enumerate(views) if segment.shape[1:] == v.shape[1:])
            parts.setdefault(index, []).append(segment.numel() * segment.element_size())
    assert any(len(sizes) > 1 for sizes in parts.values())
    for index, view in enumerate(views):
        sizes = parts[index]
        assert sum(sizes) == view.numel() * view.element_size()
        assert all(n % 8 == 0 for n in sizes[:-1]), sizes
        assert sum(packed(n) for n in sizes) == packed(view.numel() * view.element_size())


def _run(rank, world, programs):
    from nereus.runtime.executor import execute
    from nereus.runtime.program import offloaded_units, rank_program
    from nereus.runtime.state import shard_unit

    control = dist.new_group(backend="gloo")
    out = {}
    for name, program in programs.items():
        full = reference_state(program["tensors"])
        before = {u["id"]: shard_unit(u, rank, full) for u in program["units"]["before"] if rank in u["gpus"]}
        result = execute(rank_program(program, rank), before, group=None, control=control,
                         device=torch.device("cpu"), offloaded=offloaded_units(program))
        out[name] = {"peak": result.peak_bytes, "buffers": result.buffer_peak_bytes}
    return out


@pytest.mark.multiprocess
def test_the_executor_counts_them_within_the_proof_of_its_model():
    cuda, cpu = case_programs("cuda"), case_programs("cpu")
    programs = {f"cuda {k}": cuda[k] for k in ("swap", "offload B->C")}
    programs.update({f"cpu {k}": cpu[k] for k in ("swap", "offload B->C")})
    per_rank = spawn_ok(_run, 2, programs)
    proofs = {name: verify_program(program) for name, program in programs.items()}
    for name in programs:
        capacity = {g["id"]: g["capacity_bytes"] for g in programs[name]["gpus"]}
        peaks = [per_rank[rank][name]["peak"] for rank in range(2)]
        proven = [proofs[name].peak_bytes[rank] for rank in range(2)]
        if name.startswith("cuda"):
            assert all(0 < p <= q <= capacity[r] for r, (p, q) in enumerate(zip(peaks, proven))), (name, peaks, proven)
        else:  # the run counts the source's buffers that the old model's proof leaves out
            assert any(p > q for p, q in zip(peaks, proven)), (name, peaks, proven)
            assert any(p > capacity[r] for r, p in enumerate(peaks)), (name, peaks, capacity)

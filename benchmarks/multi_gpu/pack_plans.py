"""Host cost of the pack/unpack plans of a transition whose shards sit at new addresses
(one GPU, no communication).

    python benchmarks/multi_gpu/pack_plans.py            # CUDA
    python benchmarks/multi_gpu/pack_plans.py --quick    # CPU check (TRITON_INTERPRET, tiny shapes)

What the executor does per stream chunk on CUDA, for `--chunks` chunks of Qwen3-30B-A3B
expert pieces (hidden 2048, expert_ffn 768, bf16; per expert its gate and up halves,
dim-0 slices, and its down half, a dim-1 slice, as an EP 2 -> TP 2 change sends them;
`--experts` + i in chunk i, so that each chunk has a plan of its own): `packing.pack` of each chunk's views into a buffer, then
`packing.unpack` of that buffer into fresh destination shards. One "transition" is that
over every chunk, on source and destination tensors allocated anew, after a "training
step" that leaves a tensor of random size allocated (so the caching allocator hands out
other addresses, as in a real job). Per transition: the host seconds of the pack and
unpack calls (no synchronize inside), the device-inclusive seconds (synchronize at both
ends), and how many plans the packer built. Medians over `--repeats` after `--warmup`
transitions; every transition's bytes are checked. Last stdout line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

if "--quick" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("NEREUS_PACK_BACKEND", "triton")
# the runtime's default takes the torch path while a variant compiles aside; compile at
# the first call here (the warm-up transitions), so every timed call runs the kernels
os.environ.setdefault("NEREUS_PACK_JIT", "eager")

import torch  # noqa: E402

from nereus.runtime import packing  # noqa: E402


def expert_pieces(experts: int, hidden: int, ffn: int, device) -> tuple[list, list]:
    """(whole expert tensors, their pieces): gate_up [2F, H] and down [H, F] per expert,
    the second TP half of each (gate rows, up rows: contiguous; down columns: strided)."""
    tensors, views = [], []
    for _ in range(experts):
        gate_up = torch.randn(2 * ffn, hidden, device=device).to(torch.bfloat16)
        down = torch.randn(hidden, ffn, device=device).to(torch.bfloat16)
        tensors += [gate_up, down]
        half = ffn // 2
        views += [gate_up[half:ffn], gate_up[ffn + half:], down[:, half:]]
    return tensors, views


def transition(chunks: int, experts: int, hidden: int, ffn: int, device, rng: random.Random) -> dict:
    step = torch.empty(rng.randrange(1, 64) << 20, dtype=torch.uint8, device=device)  # a training step's leftover
    # chunk i holds experts + i experts: every chunk its own plan, as the chunks of a real
    # transition (other pieces, other offsets)
    sources = [expert_pieces(experts + i, hidden, ffn, device) for i in range(chunks)]
    kernels = packing.kernels()
    built = kernels.default_packer().plans_built if kernels is not None else 0
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    host = 0.0
    received = []
    for _, views in sources:
        offsets, total = packing.layout([v.numel() * v.element_size() for v in views])
        h = time.perf_counter()
        buffer = packing.pack(views, offsets, total)
        host += time.perf_counter() - h
        dests = [torch.empty(v.shape, dtype=v.dtype, device=device) for v in views]  # fresh after-shards
        h = time.perf_counter()
        packing.unpack(buffer, dests, offsets)
        host += time.perf_counter() - h
        received.append(dests)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall = time.perf_counter() - t0
    ok = all(torch.equal(d, v) for (_, views), dests in zip(sources, received) for d, v in zip(dests, views))
    del step
    return {"host_s": host, "wall_s": wall, "plans_built": (kernels.default_packer().plans_built - built)
            if kernels is not None else 0, "ok": ok}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="CPU check: tiny shapes, the Triton interpreter")
    parser.add_argument("--chunks", type=int, default=None, help="stream chunks per transition (default 16)")
    parser.add_argument("--experts", type=int, default=None, help="experts in the first chunk, one more in each next (default 20: 90-158 MiB chunks)")
    parser.add_argument("--repeats", type=int, default=None, help="timed transitions (default 11)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    quick = args.quick
    device = torch.device("cuda" if torch.cuda.is_available() and not quick else "cpu")
    chunks = args.chunks or (2 if quick else 16)
    experts = args.experts or (2 if quick else 20)
    repeats = args.repeats or (2 if quick else 11)
    hidden, ffn = (32, 16) if quick else (2048, 768)
    if device.type == "cpu" and not quick:
        parser.error("no CUDA device: run with --quick for the CPU check")
    kernels = packing.kernels()
    if quick and kernels is not None:  # the interpreter runs the kernels on CPU tensors
        packing.pack = kernels.pack_into
        packing.unpack = kernels.unpack_from
    rng = random.Random(args.seed)
    runs = [transition(chunks, experts, hidden, ffn, device, rng) for _ in range(args.warmup + repeats)]
    timed = runs[args.warmup:]
    result = {
        "name": "pack_plans", "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "backend": packing.backend_for(device) if not quick else "triton (interpreter)",
        "chunks": chunks, "experts_first_chunk": experts, "views": 3 * sum(experts + i for i in range(chunks)),
        "bytes_per_transition": sum(experts + i for i in range(chunks)) * 3 * hidden * (ffn // 2) * 2,
        "host_s_median": statistics.median(r["host_s"] for r in timed),
        "wall_s_median": statistics.median(r["wall_s"] for r in timed),
        "plans_built_per_transition": [r["plans_built"] for r in runs],
        "warm_plans_built_median": statistics.median(r["plans_built"] for r in timed),
        "verified": all(r["ok"] for r in runs), "runs": runs,
        "torch": torch.__version__,
    }
    print(f"host {result['host_s_median'] * 1e3:.2f} ms, wall {result['wall_s_median'] * 1e3:.2f} ms per transition "
          f"({chunks} chunks, {result['views']} pieces, {result['bytes_per_transition'] / 1e9:.2f} GB), plans built per transition {result['plans_built_per_transition']}, "
          f"verified {result['verified']}", file=sys.stderr)
    print(json.dumps(result))
    return 0 if result["verified"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

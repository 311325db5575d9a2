"""Same-GPU copy speed of the pieces a DP -> TP change copies (one GPU, no communication).

    python benchmarks/multi_gpu/copy_speed.py            # CUDA
    python benchmarks/multi_gpu/copy_speed.py --quick    # CPU check (tiny shapes)

Rank 0's TP-2 shards of `--layers` Llama-3.1-8B-shaped layers (embedding and LM head
included, bf16) are copied out of whole tensors: dim-0 slices (column and vocabulary
tensors: contiguous) and dim-1 slices (row tensors: strided). Per method, the median of
`--repeats` timed calls (CUDA events around the call; the host time of the call apart):

- copy_pairs: what the executor runs (`nereus.runtime.packing.copy_pairs`)
- copy_each: one `copy_` per piece
- foreach: one `_foreach_copy_` over every piece
- views_then_contiguous: what DTensor's Replicate() -> Shard(d) returns: views of the
  whole tensors for dim 0 (nothing copied, the whole tensors stay alive) and a
  `.contiguous()` copy for dim 1

and per kind of piece the copy bandwidth (bytes of the pieces / seconds) with `copy_`,
with `_foreach_copy_` (dim 0), as bf16 and widened to int32 / int64 (dim 1), and through
the pack paths (dim 1 into one buffer: the Triton kernels where they run, the torch path).
Last stdout line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

# the Triton pack variants compile at their first call (the runtime's default would take
# the torch path while they compile aside, and time that instead)
os.environ.setdefault("NEREUS_PACK_JIT", "eager")
from nereus.runtime import packing  # noqa: E402


def shapes(layers: int, quick: bool) -> list:
    """[(shape, split dim or None)] of the weights, as dtensor_compare.py splits them."""
    h, kv, f, v = (64, 16, 128, 256) if quick else (4096, 1024, 14336, 128256)
    per_layer = [((h, h), 0), ((kv, h), 0), ((kv, h), 0), ((h, h), 1), ((f, h), 0), ((f, h), 0), ((h, f), 1),
                 ((h,), None), ((h,), None)]
    return per_layer * layers + [((v, h), 0), ((v, h), 0), ((h,), None)]


def timed(fn, repeats: int, device: torch.device) -> dict:
    for _ in range(2):
        fn()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    dev, host = [], []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        out = fn()
        host.append(time.perf_counter() - t0)
        if device.type == "cuda":
            end.record()
            torch.cuda.synchronize()
            dev.append(start.elapsed_time(end) / 1e3)
        else:
            dev.append(host[-1])
        del out
    return {"device_s": statistics.median(dev), "host_s": statistics.median(host)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU check)")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    specs = shapes(args.layers, args.quick)
    gen = torch.Generator(device=device).manual_seed(0)
    whole = [torch.randn(s, generator=gen, device=device, dtype=torch.bfloat16) for s, _ in specs]
    srcs = [t if d is None else t.narrow(d, 0, t.shape[d] // 2) for t, (_, d) in zip(whole, specs)]
    nbytes = sum(v.numel() * v.element_size() for v in srcs)

    def fresh():
        return [torch.empty(v.shape, dtype=v.dtype, device=device) for v in srcs]

    def run_copy_pairs():
        out = fresh()
        packing.copy_pairs(out, srcs)
        return out

    def run_copy_each():
        out = fresh()
        for d, s in zip(out, srcs):
            d.copy_(s)
        return out

    def run_foreach():
        out = fresh()
        torch._foreach_copy_(out, srcs)
        return out

    def run_views():
        return [v if v.is_contiguous() else v.contiguous() for v in srcs]

    result = {"device": device.type, "layers": args.layers, "bytes": nbytes, "methods": {}, "kinds": {}}
    for name, fn in (("copy_pairs", run_copy_pairs), ("copy_each", run_copy_each), ("foreach", run_foreach),
                     ("views_then_contiguous", run_views)):
        result["methods"][name] = timed(fn, args.repeats, device)
    checked = all(torch.equal(a, b) for a, b in zip(run_copy_pairs(), srcs))

    for kind in (0, 1):
        pairs = [(torch.empty(v.shape, dtype=v.dtype, device=device), v) for v, (_, d) in zip(srcs, specs) if d == kind]
        size = sum(v.numel() * v.element_size() for _, v in pairs)
        ways = {"copy_": lambda ps=pairs: [a.copy_(b) for a, b in ps]}
        if kind == 0:
            ways["foreach"] = lambda ps=pairs: torch._foreach_copy_([a for a, _ in ps], [b for _, b in ps])
        else:
            for wide in (torch.int32, torch.int64):
                wp = [(a.view(wide), b.view(wide)) for a, b in pairs]
                ways[f"as_{str(wide).split('.')[1]}"] = lambda ps=wp: [a.copy_(b) for a, b in ps]
            views = [b for _, b in pairs]
            offsets, total = packing.layout([v.numel() * v.element_size() for v in views])
            buffer = torch.empty(total, dtype=torch.uint8, device=device)
            ways["torch_pack"] = lambda: packing.torch_pack(views, offsets, total, out=buffer)
            if packing.backend_for(device) == "triton":
                ways["triton_pack"] = lambda: packing.pack(views, offsets, total, out=buffer)
        result["kinds"][f"dim{kind}"] = {"bytes": size, **{
            name: size / timed(fn, args.repeats, device)["device_s"] / 1e9 for name, fn in ways.items()}}
    result["verified"] = checked
    for name, m in result["methods"].items():
        print(f"{name}: device {m['device_s'] * 1e3:.2f} ms, host {m['host_s'] * 1e3:.2f} ms", flush=True)
    for kind, ways in result["kinds"].items():
        print(f"{kind}: " + ", ".join(f"{k} {v:.0f} GB/s" for k, v in ways.items() if k != "bytes"), flush=True)
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name()
    result["torch"] = torch.__version__
    print(json.dumps(result))
    return 0 if checked else 1


if __name__ == "__main__":
    sys.exit(main())

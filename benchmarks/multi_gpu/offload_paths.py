"""Offload paths on one GPU: how a rank's pieces of an offloaded unit cross PCIe, with the
pack kernels addressing pinned host memory in place (the default) and with the copying
path (NEREUS_MAPPED_HOST=0), against one device<->host copy of the same bytes.

The pieces are those of one rank in offload_check.py's A -> C (and back): 8B-shaped
llama layers (4 by default) with embedding and LM head, bf16, each tensor split in two
TP halves, dim 0 for q/k/v/gate/up/embedding/head and dim 1 (strided) for o/down. The
rank receives the other rank's halves into its full host tensors (unpack), sends its
halves from host memory (pack), and copies its own half between its device shard and
the host tensor (copies), each through the runtime's own functions (`offload.pack`,
`offload.unpack` + `HostUnpack.finish`, `packing.copy_pairs`), in chunks of the stream's
size as a transition cuts them. Each case runs both ways in turn per repeat (interleaved),
timed from a synchronize to a synchronize; medians and the first (cold) call. Every case
is checked against the copying path's bytes.

    torchrun --standalone --nproc-per-node 1 benchmarks/multi_gpu/offload_paths.py

Run under torchrun because torchrun sets OMP_NUM_THREADS=1 per process, as in a real job
(the copying path's host work runs on that one thread). Last stdout line: {"name":
"offload_paths", "bytes", "bound_ms": {"d2h", "h2d"}, "cases": {case: {path: {"median_ms",
"cold_ms", "gbps"}}}, "checked", "machine"}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from mg_common import machine

H, F, V, KV = 4096, 14336, 128256, 1024
LAYER = (("q", (H, H), 0), ("k", (KV, H), 0), ("v", (KV, H), 0), ("o", (H, H), 1),
         ("gate", (F, H), 0), ("up", (F, H), 0), ("down", (H, F), 1))


def tensors(layers: int) -> list:
    """[(name, full shape, split dim)] of the rank's tensors."""
    out = [(f"{i}.{n}", s, d) for i in range(layers) for n, s, d in LAYER]
    return out + [("embed", (V, H), 0), ("head", (V, H), 0)]


def chunks(views: list, chunk_bytes: int) -> list:
    """The views cut as a stream cuts them (streams.chunk_views), with packed offsets."""
    from nereus.runtime import packing, streams

    out = []
    for segments in streams.chunk_views(views, chunk_bytes):
        offsets, total = packing.layout([v.numel() * v.element_size() for v in segments])
        out.append((segments, offsets, total))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("offload_paths.py needs a CUDA device")
    from nereus.runtime import offload, packing, streams

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    table = tensors(args.layers)
    host = [torch.empty(s, dtype=torch.bfloat16, pin_memory=True) for _, s, _ in table]
    theirs = [t.narrow(d, t.shape[d] // 2, t.shape[d] // 2) for t, (_, _, d) in zip(host, table)]
    mine = [t.narrow(d, 0, t.shape[d] // 2) for t, (_, _, d) in zip(host, table)]
    shards = [torch.randint(-2**15, 2**15, m.shape, dtype=torch.int16, device=device).view(torch.bfloat16)
              for m in mine]
    plan = chunks(theirs, streams.CHUNK_BYTES)
    total = sum(c[2] for c in plan)
    outgoing = [torch.empty(n, dtype=torch.uint8, device=device) for _, _, n in plan]
    incoming = [torch.randint(0, 256, (n,), dtype=torch.uint8, device=device) for _, _, n in plan]
    back = [torch.empty_like(s) for s in shards]

    def unpack():
        jobs = [offload.unpack(buf, views, offsets) for buf, (views, offsets, _) in zip(incoming, plan)]
        for job in jobs:
            if job is not None:
                job.finish()

    def pack():
        for buf, (views, offsets, _) in zip(outgoing, plan):
            offload.pack(views, offsets, buf)

    cases = {"unpack": unpack, "pack": pack,
             "copies_d2h": lambda: packing.copy_pairs(mine, shards),
             "copies_h2d": lambda: packing.copy_pairs(back, mine)}
    paths = {"in_place": "1", "copying": "0"}
    times = {c: {p: [] for p in paths} for c in cases}
    checked = {}
    whole_h = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    whole_d = torch.empty(total, dtype=torch.uint8, device=device)
    bound = {"d2h": [], "h2d": []}

    def timed(fn) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    from nereus.backends.triton import default_packer

    for rep in range(args.repeats + 1):  # repeat 0: the cold call of each
        if rep == 1 and default_packer()._compiling is not None:  # variants compiling aside since rep 0
            default_packer()._compiling.join()
        bound["d2h"].append(timed(lambda: whole_h.copy_(whole_d, non_blocking=True)))
        bound["h2d"].append(timed(lambda: whole_d.copy_(whole_h, non_blocking=True)))
        for case, fn in cases.items():
            results = {}
            for path, flag in paths.items():
                os.environ["NEREUS_MAPPED_HOST"] = flag
                times[case][path].append(timed(fn))
                if rep == 0:  # what each path wrote, for the check
                    results[path] = ([t.clone() for t in theirs] if case == "unpack" else
                                     [t.clone() for t in mine] if case == "copies_d2h" else
                                     [b.clone() for b in back] if case == "copies_h2d" else [b.clone() for b in outgoing])
            if rep == 0:
                a, b = results["in_place"], results["copying"]
                word = torch.uint8 if case == "pack" else torch.int16  # bf16 NaNs compare as bits
                checked[case] = all(torch.equal(x.view(word), y.view(word)) for x, y in zip(a, b))
    os.environ.pop("NEREUS_MAPPED_HOST", None)
    moved = {"unpack": total, "pack": total, "copies_d2h": sum(s.numel() * 2 for s in shards),
             "copies_h2d": sum(s.numel() * 2 for s in shards)}
    result = {"name": "offload_paths", "layers": args.layers, "bytes": moved, "chunks": len(plan),
              "omp_threads": torch.get_num_threads(),
              "bound_ms": {k: round(statistics.median(v[1:]) * 1e3, 2) for k, v in bound.items()},
              "cases": {c: {p: {"median_ms": round(statistics.median(v[1:]) * 1e3, 2),
                                "cold_ms": round(v[0] * 1e3, 2),
                                "gbps": round(moved[c] / statistics.median(v[1:]) / 1e9, 1)}
                            for p, v in per.items()} for c, per in times.items()},
              "checked": checked, "passed": all(checked.values()), "machine": machine()}
    for c, per in result["cases"].items():
        print(f"{c:11s} " + "  ".join(f"{p} {v['median_ms']:8.2f} ms ({v['gbps']:5.1f} GB/s, cold {v['cold_ms']:.1f})"
                                      for p, v in per.items()), flush=True)
    text = json.dumps(result)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

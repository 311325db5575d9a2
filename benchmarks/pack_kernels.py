"""Fused pack/unpack kernels (nereus.backends.triton) against the copy ceiling, on one GPU.

First checks correctness on the device (fresh random data, poisoned outputs, byte-exact
against the per-segment torch fallback; a tensor past 2**31 elements), then times:

  sweep_<size>x<count>   pack + unpack of `count` strided boxes of `size` bytes (2-D boxes,
                         2 KiB rows, every other half-row of a source tensor); bound =
                         4 x bytes / ceiling (pack reads + writes, unpack reads + writes)
  llama8b_tp2_tp4_loopback
                         real-size Llama-3.1-8B bf16 weights resharded TP=2 -> TP=4 on one
                         GPU (1,164 segments: column part-wise, row, vocab, replicated);
                         with fewer layers where the device's free memory does not hold
                         8 copies of the model (llama8b_<L>of32layers_..., e.g. an 80 GB H100):
                         fused = one box-to-box copy launch; bound = 2 x bytes / ceiling
  llama8b_tp2_tp4_pack_unpack
                         the same through per-(src, dst)-rank buffers: pack_many + unpack_many
                         (what a cross-GPU run does around NCCL); same bound, so >= 2x by design
  small_16384x64KiB, small_65536x4KiB
                         gather of many small segments into one buffer; bound = 2 x bytes /
                         ceiling; CUDA-graph replays of both versions reported beside

Every case also times the best batched torch forms a user would write instead of one
`copy_` per segment (`batched_torch`, each checked byte for byte first): one
`torch._foreach_copy_` over all segments (pack into, and unpack from, views of the
buffer), `torch.cat` of the segment views into each message buffer (unpacked with
`_foreach_copy_`), and, where every segment is a row range of one tensor (the sweep),
`index_select` / `index_copy_` of those rows; `best_batched_torch_s` is the fastest and
`fused_over_best_batched` the ratio that matters.

ceiling = a single large device-to-device copy, bytes read + written per second.
Timings: triton.testing.do_bench medians (CUDA events). Cached plans (`key=`) throughout;
plan build (host) times are reported separately.

    PYTHONPATH=. python3 benchmarks/pack_kernels.py --out $OUT/pack.json
    PYTHONPATH=. python benchmarks/pack_kernels.py --smoke     # CPU, interpreter, tiny sizes

Last stdout line: one JSON object {"name": "pack_kernels", "copy_ceiling_GBps": ..., "cases": [...]}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # smoke runs on the CPU

from nereus.backends.triton import Packer, SegmentView, layout  # noqa: E402
from nereus.models import COLUMN, REPLICATED, ROW, VOCAB, tensor_table  # noqa: E402
from nereus.ir.model import Model  # noqa: E402

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
POISON = 0x7F  # bytes 0x7F7F: a NaN in bf16/fp16 and fp32, never a real weight


def bench(fn, ms: float = 200.0) -> float:
    """Median seconds of fn() (CUDA events via do_bench; perf_counter on the CPU)."""
    if torch.cuda.is_available():
        import triton.testing
        return triton.testing.do_bench(fn, warmup=max(25, ms / 4), rep=ms, return_mode="median") / 1e3
    fn()
    times = []
    for _ in range(3):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[1]


def graph_of(fn):
    """fn captured in a CUDA graph (after one warm call), or None on the CPU."""
    if not torch.cuda.is_available():
        return None
    fn()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def dense_bytes(t: torch.Tensor) -> torch.Tensor:
    if t.is_contiguous() and t.dim() and t.reshape(-1).stride(0) == 1:
        return t.reshape(-1).view(torch.uint8)  # the 16 GB shards: no copy
    dense = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    dense.copy_(t)
    return dense.reshape(-1).view(torch.uint8)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(dense_bytes(a), dense_bytes(b))


# -- correctness ---------------------------------------------------------------------------

def random_segments(rng: random.Random, device, count: int, distinct: bool) -> list[SegmentView]:
    """Random boxes (rank 1-3, often non-contiguous, some empty) of bf16/fp16/fp32 tensors."""
    def tensor():
        shape = [rng.randint(1, 300) for _ in range(rng.randint(1, 3))]
        t = torch.randn(shape, device=device).to(rng.choice((torch.bfloat16, torch.float16, torch.float32)))
        if t.dim() > 1 and rng.random() < 0.4:
            t = t.transpose(0, -1)
        if rng.random() < 0.3:
            t = t[..., 1::2] if t.shape[-1] > 1 else t
        return t
    pool = [tensor() for _ in range(max(1, count // 3))]
    segments = []
    for _ in range(count):
        t = tensor() if distinct else rng.choice(pool)
        starts = [rng.randint(0, n - 1) for n in t.shape]
        sizes = [rng.randint(1, n - s) if rng.random() > 0.05 else 0 for n, s in zip(t.shape, starts)]
        segments.append(SegmentView(t, tuple(starts), tuple(sizes)))
    return segments


def check_correctness(device, smoke: bool) -> list[str]:
    fused, plain = Packer("triton"), Packer("torch")
    rng = random.Random(int(time.time()))
    checks = []
    for trial in range(2 if smoke else 6):
        segs = random_segments(rng, device, 8 if smoke else 200, distinct=False)
        total = layout([s.view() for s in segs])[1]
        a = fused.pack(segs, out=torch.full((total,), POISON, dtype=torch.uint8, device=device))
        b = plain.pack(segs, out=torch.full((total,), POISON, dtype=torch.uint8, device=device))
        assert torch.equal(a, b), f"pack mismatch (trial {trial})"
        dsts = random_segments(rng, device, len(segs), distinct=True)
        for d in dsts:
            d.tensor.fill_(float("nan"))
        buffer = torch.randint(0, 256, (layout([d.view() for d in dsts])[1],), dtype=torch.uint8, device=device)
        copies = [SegmentView(d.tensor.clone(), d.starts, d.sizes) for d in dsts]
        fused.unpack(buffer, dsts)
        plain.unpack(buffer, copies)
        assert all(same_bytes(d.tensor, c.tensor) for d, c in zip(dsts, copies)), f"unpack mismatch ({trial})"
    checks.append("random pack/unpack tables")
    # int64 addressing: boxes of a tensor of more than 2**31 elements
    n = 2**31 + 2**22 if not smoke else 16 * 2048
    big = torch.empty(n, dtype=torch.bfloat16, device=device).view(-1, 2048)
    big[-8:].normal_()
    segs = [SegmentView(big, (big.shape[0] - 6, 100), (5, 1000)), SegmentView(big, (big.shape[0] - 1, 0), (1, 2048))]
    a = fused.pack(segs)
    assert torch.equal(a, plain.pack(segs)), "pack mismatch past 2**31 elements"
    fused.unpack(torch.flip(a, (0,)), segs)
    back = plain.pack(segs)
    assert torch.equal(back, torch.flip(a, (0,))), "unpack mismatch past 2**31 elements"
    checks.append(f"tensor of {n} elements")
    del big
    return checks


# -- Llama TP reshard segments -----------------------------------------------------------

def tp_ranges(spec, tp: int, rank: int) -> list[tuple[int, int, int, int]]:
    """(dim, global lo, global hi, local lo) of each box rank `rank` holds of `spec`."""
    if spec.sharding == REPLICATED:
        return [(0, 0, spec.shape[0], 0)]
    if spec.sharding == ROW:
        w = spec.shape[1] // tp
        return [(1, rank * w, (rank + 1) * w, 0)]
    if spec.sharding == VOCAB:
        w = spec.shape[0] // tp
        return [(0, rank * w, (rank + 1) * w, 0)]
    assert spec.sharding == COLUMN
    out, start, local = [], 0, 0
    for part in spec.parts:
        w = part.rows // tp
        out.append((0, start + rank * w, start + (rank + 1) * w, local))
        start, local = start + part.rows, local + w
    return out


def shard_shape(spec, tp: int) -> list[int]:
    shape = list(spec.shape)
    if spec.sharding == ROW:
        shape[1] //= tp
    elif spec.sharding in (VOCAB, COLUMN):
        shape[0] //= tp
    return shape


def reshard_plan(model: Model, tp_from: int, tp_to: int):
    """Yield (spec, src rank, dst rank, dim, src local lo, dst local lo, length): the boxes
    that TP=tp_to ranks need from TP=tp_from ranks (replicated: from rank dst % tp_from)."""
    for spec in tensor_table(model):
        for dst in range(tp_to):
            for dim, glo, ghi, dlo in tp_ranges(spec, tp_to, dst):
                sources = [dst % tp_from] if spec.sharding == REPLICATED else range(tp_from)
                for src in sources:
                    for sdim, slo, shi, sloc in tp_ranges(spec, tp_from, src):
                        lo, hi = max(glo, slo), min(ghi, shi)
                        if sdim == dim and lo < hi:
                            yield spec, src, dst, dim, sloc + lo - slo, dlo + lo - glo, hi - lo


def build_loopback(model: Model, tp_from: int, tp_to: int, device):
    specs = tensor_table(model)
    src = [{s.name: torch.randn(shard_shape(s, tp_from), device=device).to(torch.bfloat16) for s in specs}
           for _ in range(tp_from)]
    dst = [{s.name: torch.empty(shard_shape(s, tp_to), dtype=torch.bfloat16, device=device) for s in specs}
           for _ in range(tp_to)]
    ref = [{k: torch.full_like(v, float("nan")) for k, v in d.items()} for d in dst]
    pairs, ref_pairs, messages = [], [], {}
    for spec, r_src, r_dst, dim, slo, dlo, n in reshard_plan(model, tp_from, tp_to):
        a = src[r_src][spec.name].narrow(dim, slo, n)
        b = dst[r_dst][spec.name].narrow(dim, dlo, n)
        pairs.append((a, b))
        ref_pairs.append((a, ref[r_dst][spec.name].narrow(dim, dlo, n)))
        messages.setdefault((r_src, r_dst), []).append((a, b))
    return dst, ref, pairs, ref_pairs, messages


# -- batched torch baselines -----------------------------------------------------------------

def buffer_views(buf: torch.Tensor, views, align: bool = True) -> list:
    """Views of `buf` (uint8) shaped like `views`, at the packer's aligned offsets (align)
    or back to back (the layout torch.cat writes)."""
    if align:
        offsets = layout(views)[0]
    else:
        offsets, at = [], 0
        for v in views:
            offsets.append(at)
            at += v.numel() * v.element_size()
    return [buf[o: o + v.numel() * v.element_size()].view(v.dtype).view(v.shape) for o, v in zip(offsets, views)]


def batched_torch(messages, index_select=None) -> dict:
    """Seconds of the batched torch forms of moving `messages` — [(sources, destinations or
    None)], each message packed into one buffer, then unpacked into its destinations (None:
    pack only) — keyed by form, each checked byte for byte before it is timed."""
    device = messages[0][0][0].device
    aligned, dense = [], []
    for srcs, _ in messages:
        aligned.append(buffer_views(torch.empty(layout(srcs)[1], dtype=torch.uint8, device=device), srcs))
        nbytes = sum(v.numel() * v.element_size() for v in srcs)
        dense.append((torch.empty(nbytes, dtype=torch.uint8, device=device), srcs))
    dense_views = [buffer_views(buf, srcs, align=False) for buf, srcs in dense]
    flat_srcs = [v for srcs, _ in messages for v in srcs]
    flat_bufs = [v for views in aligned for v in views]
    flat_dsts = [v for _, dsts in messages if dsts is not None for v in dsts]
    unpack = all(dsts is not None for _, dsts in messages)

    def foreach():
        torch._foreach_copy_(flat_bufs, flat_srcs)
        if unpack:
            torch._foreach_copy_(flat_dsts, flat_bufs)

    def cat():
        for (buf, srcs) in dense:
            dtypes = {v.dtype for v in srcs}
            if len(dtypes) == 1:  # one launch per message
                torch.cat([v.reshape(-1) for v in srcs], out=buf.view(dtypes.pop()))
            else:
                torch._foreach_copy_(buffer_views(buf, srcs, align=False), srcs)
        if unpack:
            torch._foreach_copy_(flat_dsts, [v for views in dense_views for v in views])

    forms = {"foreach_copy": (foreach, flat_bufs), "cat": (cat, [v for views in dense_views for v in views])}
    if index_select is not None:
        forms["index_select"] = (index_select, None)
    out = {}
    for name, (run, packed) in forms.items():
        check = flat_dsts if unpack else packed
        for v in check or ():
            v.fill_(float("nan"))  # poisoned: what an earlier form wrote cannot pass for this one's
        run()
        sync()
        if check is not None:
            assert all(same_bytes(a, b) for a, b in zip(flat_srcs[:64], check[:64])), f"batched torch {name} mismatch"
        out[name] = bench(run, ms=100)
    return out


def with_batched(row: dict, forms: dict) -> dict:
    best = min(forms, key=forms.get)
    row.update({f"torch_{k}_s": v for k, v in forms.items()})
    row.update(best_batched_torch=best, best_batched_torch_s=forms[best],
               fused_over_best_batched=row["fused_s"] / forms[best])
    print(f"{'':32s} batched torch: " + "  ".join(f"{k} {v * 1e3:.3f} ms" for k, v in forms.items())
          + f"  fused/best {row['fused_over_best_batched']:.3f}", flush=True)
    return row


# -- cases ---------------------------------------------------------------------------------

def case(name, fused_s, per_segment_s, bound_s, **extra):
    row = {"case": name, "fused_s": fused_s, "per_segment_s": per_segment_s, "bound_s": bound_s,
           "fused_over_bound": fused_s / bound_s, "per_segment_over_bound": per_segment_s / bound_s}
    row.update(extra)
    print(f"{name:32s} fused {fused_s * 1e3:10.3f} ms  per-seg {per_segment_s * 1e3:10.3f} ms  "
          f"bound {bound_s * 1e3:9.3f} ms  fused/bound {fused_s / bound_s:6.2f}  "
          + "  ".join(f"{k} {v:.4g}" for k, v in extra.items() if isinstance(v, float)), flush=True)
    return row


def sweep_case(size: int, count: int, ceiling: float, device, fused: Packer, plain: Packer):
    """`count` boxes of `size` bytes: rows of 2 KiB (half of a 4 KiB bf16 row), shuffled."""
    rows_per = max(1, size // (2 * KiB))
    width = 2048  # bf16 elements per source row; a box takes 1024 of them
    src = torch.randn(count * rows_per, width, device=device).to(torch.bfloat16)
    dst = torch.empty_like(src)
    order = list(range(count))
    random.Random(count).shuffle(order)
    segs = [SegmentView(src, (k * rows_per, (k % 2) * 1024), (rows_per, 1024)) for k in order]
    back = [SegmentView(dst, s.starts, s.sizes) for s in segs]
    nbytes = count * rows_per * 2 * KiB
    buf = torch.empty(layout([s.view() for s in segs])[1], dtype=torch.uint8, device=device)
    key = ("sweep", size, count)

    def run(packer):
        packer.pack(segs, out=buf, key=key)
        packer.unpack(buf, back, key=key)
    run(fused)
    sync()
    assert all(same_bytes(a.view(), b.view()) for a, b in zip(segs[:50], back[:50])), "sweep round trip"
    t_fused = bench(lambda: run(fused))
    t_plain = bench(lambda: run(plain), ms=100)
    bound = 4 * nbytes / ceiling
    # every box is rows_per rows of one half of src's rows: one index_select / index_copy_
    halves, dst_halves = src.view(-1, 1024), dst.view(-1, 1024)
    rows = torch.tensor([(k * rows_per + r) * 2 + k % 2 for k in order for r in range(rows_per)], device=device)
    gathered = torch.empty(len(rows), 1024, dtype=src.dtype, device=device)

    def index_select():
        torch.index_select(halves, 0, rows, out=gathered)
        dst_halves.index_copy_(0, rows, gathered)

    forms = batched_torch([([s.view() for s in segs], [b.view() for b in back])], index_select)
    return with_batched(case(f"sweep_{size // KiB}KiBx{count}", t_fused, t_plain, bound, bytes=nbytes,
                             fused_fraction_of_ceiling=bound / t_fused, launches=fused.launch_summary("pack", key)),
                        forms)


def ptx_report(pairs, device) -> dict:
    """Vector width of the loopback launch's global loads/stores, with and without the
    16-byte hints, read from the PTX Triton generated (no hardware counters needed)."""
    import re

    from nereus.backends.triton import kernels, segments, tables
    pieces = [p for a, b in pairs for p in segments.copy_pieces(a, b)]
    report = {}
    for max_vec in (2, 1):
        for launch in tables.build_launches(pieces, kernels.anchor(device).data_ptr(), max_vec=max_vec):
            try:
                ptx = kernels.run_launch(launch.to(device), kernels.REL_NONE, None).asm["ptx"]
            except Exception as error:  # noqa: BLE001 - a report, never a failure
                report[f"vec{max_vec}"] = f"no ptx: {error}"
                continue
            report[f"w{launch.word}v{launch.vec}_{launch.rows}x{launch.cols}"] = {
                op: {w: len(re.findall(rf"{op}\.global[.\w]*{w}\.", ptx)) for w in (".v2", ".v4", "")}
                for op in ("ld", "st")}
    return report


def poison(shards):
    for d in shards:
        for t in d.values():
            t.view(torch.uint8).fill_(POISON)


def loopback_cases(model: Model, ceiling: float, device, fused: Packer, plain: Packer, name: str = "llama8b"):
    dst, ref, pairs, ref_pairs, messages = build_loopback(model, 2, 4, device)
    poison(dst)
    t0 = time.perf_counter()
    fused.copy(pairs, key="loopback")
    sync()
    build_s = time.perf_counter() - t0
    plain.copy(ref_pairs, key="loopback-ref")
    sync()
    assert all(same_bytes(dst[r][k], ref[r][k]) for r in range(4) for k in dst[r]), "loopback copy mismatch"
    nbytes = sum(t.numel() * t.element_size() for d in dst for t in d.values())
    bound = 2 * nbytes / ceiling
    t_fused = bench(lambda: fused.copy(pairs, key="loopback"))
    t_again = bench(lambda: fused.copy(pairs, key="loopback"))
    t_plain = bench(lambda: plain.copy(pairs, key="loopback-plain"))
    novec = Packer("triton", max_vec=1)
    t_novec = bench(lambda: novec.copy(pairs, key="loopback"))
    replay = graph_of(lambda: fused.copy(pairs, key="loopback"))
    extra = {"fused_graph_s": bench(replay)} if replay is not None else {}
    for tile in ((32, 128), (8, 512), (4, 1024), (2, 2048), (8, 256), (4, 512)):
        forced = Packer("triton", tile=tile)
        extra[f"tile_{tile[0]}x{tile[1]}_s"] = bench(lambda: forced.copy(pairs, key="loopback"))
    rows = [case(f"{name}_tp2_tp4_loopback", t_fused, t_plain, bound, segments=len(pairs), bytes=nbytes,
                 fused_repeat_s=t_again, no_vec_hints_s=t_novec, plan_build_s=build_s,
                 launches=fused.launch_summary("copy", "loopback"), **extra)]
    # box to box with no buffer: the batched torch form is one _foreach_copy_
    srcs, dsts = [a for a, _ in pairs], [b for _, b in pairs]

    def foreach_direct():
        torch._foreach_copy_(dsts, srcs)
    foreach_direct()
    sync()
    assert all(same_bytes(a, b) for a, b in pairs), "loopback _foreach_copy_ mismatch"
    with_batched(rows[0], {"foreach_copy": bench(foreach_direct)})
    if device.type == "cuda":
        rows[0]["ptx"] = ptx_report(pairs, device)
        print("ptx global access widths:", json.dumps(rows[0]["ptx"]), flush=True)
    # through buffers: one message per (src rank, dst rank), packed by one launch, unpacked by one
    keys = sorted(messages)
    send = [[a for a, _ in messages[k]] for k in keys]
    recv = [[b for _, b in messages[k]] for k in keys]
    poison(dst)
    bufs = fused.pack_many(send, key="lb-pack")
    fused.unpack_many(bufs, recv, key="lb-unpack")
    sync()
    assert all(same_bytes(dst[r][k], ref[r][k]) for r in range(4) for k in dst[r]), "loopback pack/unpack mismatch"

    def through(packer):
        b = packer.pack_many(send, key="lb-pack")
        packer.unpack_many(b, recv, key="lb-unpack")
    t_fused = bench(lambda: through(fused))
    t_plain = bench(lambda: through(plain))
    rows.append(with_batched(case(f"{name}_tp2_tp4_pack_unpack", t_fused, t_plain, bound, segments=len(pairs),
                                  bytes=nbytes, messages=len(keys)),
                             batched_torch(list(zip(send, recv)))))
    return rows


def small_case(count: int, size: int, ceiling: float, device, fused: Packer, plain: Packer):
    """Gather `count` contiguous `size`-byte chunks, scattered over 16 source tensors."""
    per = size // 4
    sources = [torch.randn(2 * count // 16 + 1, per, device=device) for _ in range(16)]
    order = list(range(2 * count))
    random.Random(size).shuffle(order)
    segs = [sources[k % 16][k // 16] for k in order[:count]]
    total = layout(segs)[1]
    buf = torch.full((total,), POISON, dtype=torch.uint8, device=device)
    t0 = time.perf_counter()
    fused.pack(segs, out=buf, key=("small", count))
    sync()
    build_s = time.perf_counter() - t0
    ref = plain.pack(segs, key=("small", count))
    assert torch.equal(buf, ref), "small-segment gather mismatch"
    nbytes = count * size
    bound = 2 * nbytes / ceiling
    t_fused = bench(lambda: fused.pack(segs, out=buf, key=("small", count)))
    t_plain = bench(lambda: plain.pack(segs, out=buf, key=("small", count)), ms=50)
    extra = {"bytes": nbytes, "plan_build_s": build_s, "launches": fused.launch_summary("pack", ("small", count))}
    replay = graph_of(lambda: fused.pack(segs, out=buf, key=("small", count)))
    if replay is not None:
        extra["fused_graph_s"] = bench(replay)
        replay_plain = graph_of(lambda: plain.pack(segs, out=buf, key=("small", count)))
        extra["per_segment_graph_s"] = bench(replay_plain, ms=50)
        del replay_plain
    return with_batched(case(f"small_{count}x{size // KiB}KiB", t_fused, t_plain, bound, **extra),
                        batched_torch([(segs, None)]))


# the model's bf16 bytes the loopback cases hold at once: TP=2 sources, TP=4 destinations,
# the fallback's reference, the checked pack_many buffers and those of a timed call, the
# batched-torch forms' aligned and dense buffers (7), and one more for the allocator's slack
LOOPBACK_COPIES = 8
FULL_LLAMA8B = Model("actor", "llama", 32, 4096, 32, 8, 14336, 128256)


def loopback_model(free_bytes: int) -> Model:
    """Llama-3.1-8B with as many of its 32 layers as fit LOOPBACK_COPIES times in
    `free_bytes` (all 32 on a 141 GB H200; an 80 GB H100 ran out of memory with them)."""
    from dataclasses import replace

    from nereus.models import parameter_count

    layers = FULL_LLAMA8B.layers
    while layers > 1 and LOOPBACK_COPIES * 2 * parameter_count(replace(FULL_LLAMA8B, layers=layers)) > free_bytes:
        layers -= 1
    return replace(FULL_LLAMA8B, layers=layers)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the JSON result here")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (CPU interpreter)")
    args = parser.parse_args()
    smoke = args.smoke or not torch.cuda.is_available()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    fused, plain = Packer("triton"), Packer("torch")
    print(f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}  torch {torch.__version__}  "
          f"python {platform.python_version()}  smoke {smoke}", flush=True)
    checks = check_correctness(device, smoke)
    print("correct:", "; ".join(checks), flush=True)

    n = (4 * GiB if not smoke else 4 * MiB) // 2
    a = torch.randn(n, device=device).to(torch.bfloat16).view(torch.uint8)  # 2n bytes
    b = torch.empty_like(a)
    ceiling = 2 * a.numel() / bench(lambda: b.copy_(a))
    del a, b
    print(f"copy ceiling {ceiling / 1e9:.1f} GB/s (read + write)", flush=True)

    cases = []
    sizes = (4 * KiB, 64 * KiB, 1 * MiB, 16 * MiB, 64 * MiB) if not smoke else (4 * KiB, 64 * KiB)
    counts = (1, 10, 100, 1000, 10000) if not smoke else (1, 10)
    limit = 2 * GiB if not smoke else 1 * MiB
    for size in sizes:
        for count in counts:
            if size * count <= limit:
                cases.append(sweep_case(size, count, ceiling, device, fused, plain))
                torch.cuda.empty_cache() if device.type == "cuda" else None
    name = "llama8b"
    if smoke:
        model = Model("actor", "llama", 2, 64, 4, 4, 128, 256)
    else:  # sized to this device's free memory
        torch.cuda.empty_cache()
        free = torch.cuda.mem_get_info()[0]
        model = loopback_model(free)
        print(f"loopback model: Llama-3.1-8B with {model.layers} of {FULL_LLAMA8B.layers} layers "
              f"({free / 1e9:.1f} GB free)", flush=True)
        if model.layers < FULL_LLAMA8B.layers:  # the names of earlier results are the whole model's
            name = f"llama8b_{model.layers}of32layers"
    cases += loopback_cases(model, ceiling, device, fused, plain, name)
    torch.cuda.empty_cache() if device.type == "cuda" else None
    for count, size in ((16384, 64 * KiB), (65536, 4 * KiB)) if not smoke else ((64, 4 * KiB),):
        cases.append(small_case(count, size, ceiling, device, fused, plain))
    result = {"name": "pack_kernels", "copy_ceiling_GBps": ceiling / 1e9, "device": str(device),
              "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
              "torch": torch.__version__, "checks": checks, "cases": cases}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

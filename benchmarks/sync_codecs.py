"""Weight-sync codecs on one GPU: the delta encode/decode and FP8 quantize kernels against
the HBM bound, the FP8 linear path, and a 70B-shaped layer set's sync bytes dense vs
delta vs FP8 vs FP8+delta (docs/program.md, "Weight-sync codecs").

  kernels   messages of 64 MiB and more (bf16 words; 0.1%, 1% and 10% of them changed):
            delta encode (nereus.backends.triton.delta: reads the message and its reference,
            writes the payload, the directory, the changed words into the reference) and
            decode (reads the receiver's bytes and the payload, writes the changed words);
            FP8 quantize of a bf16 [rows, cols] weight (reads 2 bytes, writes 1 byte an
            element and 4 per 128 x 128 block). Bandwidth = bytes read + written / time,
            against the ceiling (one large device-to-device copy, read + write) and the
            device's nominal HBM bandwidth. CUDA events around each call, medians of
            --repeats after --warmup calls; state reset between calls outside the events.
  fp8_linear
            which FP8 matmul nereus.models.fp8.linear runs on this GPU (blockwise
            F.scaled_mm, or dequantize) and its error against the dequantized fp32 matmul.
  sync_bytes
            a Llama-3-70B-shaped actor (hidden 8192, 64 heads, 8 KV heads, ffn 28672,
            vocab 128256, --layers layers, bf16), trained at tp 8 and generating at dp 2
            x tp 4 on GPUs 0..7: the compiled sync programs' messages of all 8 ranks are
            built on this one GPU from the real shards (nereus.runtime.codec_sync), then
            the weights take --steps Adam-like steps (fp32 master, every element moved by
            lr: Adam's first-step size) and each step's messages are delta-coded against
            the last ones and decoded onto them (checked equal to the new messages).
            Bytes: dense (a full sync), delta, FP8 (scales included), FP8+delta; the
            layers' share and the ratio for the whole 80-layer model (edges once, the
            measured layers x 80 / --layers: embed and lm_head, bf16 in both, are 2.1 B of
            its 70.6 B parameters but dominate a few-layer set).

    PYTHONPATH=. python benchmarks/sync_codecs.py --out $OUT/sync_codecs     # one H100/H200
    PYTHONPATH=. python benchmarks/sync_codecs.py --quick                     # CPU smoke test

Last stdout line: one JSON object (also written to OUT/sync_codecs.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from nereus.ir.model import Cluster, GpuSpec, Model, ModelStage, Module, Placement, Plan, Workload  # noqa: E402
from nereus.models import tensor_table  # noqa: E402
from nereus.models.fp8 import PATHS, Fp8Weight, linear  # noqa: E402
from nereus.passes.delta import CHUNK  # noqa: E402
from nereus.runtime import delta_codec, fp8  # noqa: E402

MiB = 1 << 20
NOMINAL = {"H200": 4.8e12, "H100": 3.35e12}  # bytes/s, SXM spec sheets


def _timer(device):
    if device.type == "cuda":
        def measure(call, reset=None):
            if reset is not None:
                reset()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            call()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3
    else:
        def measure(call, reset=None):
            if reset is not None:
                reset()
            started = time.perf_counter()
            call()
            return time.perf_counter() - started
    return measure


def _median(measure, call, reset, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        measure(call, reset)
    return statistics.median(measure(call, reset) for _ in range(repeats))


def ceiling(device, nbytes: int, warmup: int, repeats: int) -> float:
    """Bytes read + written per second of one device-to-device copy."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    seconds = _median(_timer(device), lambda: dst.copy_(src), None, warmup, repeats)
    return 2 * nbytes / seconds


def kernels(device, sizes, fractions, warmup, repeats, bound) -> list:
    measure, out = _timer(device), []
    for size in sizes:
        n = size // 2
        cur = torch.randint(-2 ** 15, 2 ** 15, (n,), dtype=torch.int16, device=device)
        for fraction in fractions:
            old = cur.clone()
            where = torch.rand(n, device=device) < fraction
            old[where] += 1
            ref = old.clone()
            head = payload = None

            def encode():
                nonlocal head, payload
                head, payload = delta_codec.encode(cur.view(torch.uint8), ref.view(torch.uint8), 2, CHUNK)

            seconds = _median(measure, encode, lambda: ref.copy_(old), warmup, repeats)
            total = delta_codec.header_of(head)[0]
            changed = int(where.sum())
            chunks = -(-n // CHUNK)
            moved = 2 * size + total + 2 * changed + head.numel() + 16 * chunks
            out.append({"kernel": "delta_encode", "message_MiB": size // MiB, "changed": fraction,
                        "coded_fraction": (total + head.numel()) / size, "seconds": seconds,
                        "bytes_read_written": moved, "GBps": moved / seconds / 1e9, "of_ceiling": moved / seconds / bound})
            dst = old.clone()
            sums = None

            def decode():
                nonlocal sums
                sums = delta_codec.decode(dst.view(torch.uint8), head, payload[:total], 2, CHUNK)

            seconds = _median(measure, decode, lambda: dst.copy_(old), warmup, repeats)
            exact = torch.equal(dst, cur) and sums == delta_codec.header_of(head)[1:3]
            moved = size + total + 2 * changed + head.numel() + 16 * chunks
            out.append({"kernel": "delta_decode", "message_MiB": size // MiB, "changed": fraction, "seconds": seconds,
                        "bytes_read_written": moved, "GBps": moved / seconds / 1e9,
                        "of_ceiling": moved / seconds / bound, "exact": exact})
        del cur
        rows = _rows(size)
        cols = size // 2 // rows
        x = (torch.randn(rows, cols, device=device) * 0.02).to(torch.bfloat16)
        codes = torch.empty(rows, cols, dtype=torch.uint8, device=device)
        seconds = _median(measure, lambda: fp8.quantize(x, 0, 0, 128, codes=codes), None, warmup, repeats)
        moved = 2 * rows * cols + rows * cols + 4 * (-(-rows // 128)) * (-(-cols // 128))
        out.append({"kernel": "fp8_quantize", "message_MiB": size // MiB, "shape": [rows, cols], "seconds": seconds,
                    "bytes_read_written": moved, "GBps": moved / seconds / 1e9, "of_ceiling": moved / seconds / bound})
        del x, codes
    return out


def _rows(size: int) -> int:
    """Rows of a square-ish bf16 weight of `size` bytes (powers of two)."""
    elements = size // 2
    rows = 1
    while rows * rows * 2 <= elements:
        rows *= 2
    return rows


def fp8_linear(device) -> dict:
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = (torch.randn(256, 8192, generator=gen) * 0.5).to(device, torch.bfloat16)
    w = (torch.randn(4096, 8192, generator=gen) * 0.02).to(device, torch.bfloat16)
    codes, scales = fp8.quantize(w, 0, 0, 128)
    weight = Fp8Weight(codes.view(torch.float8_e4m3fn), scales)
    PATHS.clear()
    got = linear(x, weight).float()
    want = x.float() @ weight.dequantize(torch.float32).t()
    return {"paths": dict(PATHS), "max_rel_error": float((got - want).abs().max() / want.abs().max())}


def module_70b(layers: int, quick: bool) -> Module:
    dims = dict(hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256)
    if quick:  # 8x narrower (ffn rounded so that tp 8 splits it into whole 128-row blocks, as 70B's does)
        dims = dict(hidden=1024, heads=8, kv_heads=8, ffn=4096, vocab=1024)
    actor = Model("actor", "llama", layers, dims["hidden"], dims["heads"], dims["kv_heads"], dims["ffn"],
                  dims["vocab"], "bf16")
    workload = Workload("rl", 8, 8, 8, 1, (("generation", ("actor",)), ("training", ("actor",))))
    cluster = Cluster("h100x8", 1, 8, GpuSpec(80 << 30, 989e12, 3.35e12), 450e9, 50e9, 2 << 40)
    plans = []
    for name, quant in (("bf16", None), ("fp8", "fp8")):
        gen = Placement(ModelStage("actor", "generation"), 2, 4, 1, tuple(range(8)), (), quant=quant)
        train = Placement(ModelStage("actor", "training"), 1, 8, 1, tuple(range(8)), ())
        plans.append(Plan(name, None, (gen, train), (gen, train)))
    return Module(cluster, (actor,), workload, tuple(plans), ())


def sync_bytes(device, layers: int, steps: int, lrs, quick: bool) -> dict:
    """The `sync_bytes` part of the module docstring."""
    from nereus.backends.json_program import plan_units_json
    from nereus.runtime.codec_sync import CodecSync
    from nereus.runtime.codec_work import lower
    from nereus.runtime.state import shard_unit, unit_on_gpu
    from nereus.runtime.vllm_sync import SYNC_FROM, SYNC_TO, compile_weight_sync

    module = module_70b(layers, quick)
    gen = torch.Generator(device=device).manual_seed(1)
    base = {f"actor/{s.name}": (torch.randn(s.shape, generator=gen, device=device) * 0.02).to(torch.bfloat16)
            for s in tensor_table(module.model("actor"))}
    numel = sum(t.numel() for t in base.values())
    ranks = {}  # plan -> [(rank, its training unit (weights only), its CodecSync)]
    for plan in ("bf16", "fp8"):
        program = compile_weight_sync(module, plan, mode="delta")
        units = plan_units_json(module, plan, "actor.training")
        ranks[plan] = []
        for rank in range(8):
            unit = unit_on_gpu(units, rank)
            unit = dict(unit, shards=[s for s in unit["shards"] if "#" not in s["tensor"]])
            work = lower(program, rank)
            # the shapes split into whole 128 x 128 blocks at tp 8 and tp 4: no amax exchange
            # between ranks, which one process could not run
            assert not work.amax_sends and not work.amax_recvs
            ranks[plan].append((rank, unit, CodecSync(work, SYNC_FROM, SYNC_TO, device, None, None, rank=rank)))
    out = {"layers": layers, "parameters": numel, "shape": "quick (8x narrower)" if quick else "Llama-3-70B",
           "lr": {}}
    for lr in lrs:
        weights = {name: t.clone() for name, t in base.items()}
        master = {name: t.float() for name, t in base.items()}
        references: dict = {}
        found = {plan: {"dense": [], "delta": [], "verified": True} for plan in ranks}
        changed = []
        for step in range(steps + 1):
            if step:  # an Adam-like step: every element moves by lr (Adam's first-step size), in fp32
                moved = 0
                for name, m in master.items():
                    m.add_(torch.randn(m.shape, generator=gen, device=device).sign_(), alpha=lr)
                    new = m.to(torch.bfloat16)
                    moved += int((new != weights[name]).sum())
                    weights[name].copy_(new)
                changed.append(moved / numel)
            for plan, members in ranks.items():
                dense = coded = 0
                if not step:  # a full sync's bytes of the layers' tensors and of the edges (embed, norm, head)
                    found[plan]["layer_bytes"] = sum(_piece_bytes(m, p, q) for _, _, sync in members
                                                     for rnd in sync.work.rounds for m in rnd.sends
                                                     for p, q in zip(m.msg.pieces, m.quant) if "layers." in p.tensor)
                for rank, unit, sync in members:
                    local = shard_unit(unit, rank, weights, device)
                    sources = {held: local for held in sync.work.prog.before}  # the sync program's unit ids
                    given = sync._prologue(sources)
                    for k, rnd in enumerate(sync.work.rounds):
                        for m in rnd.sends:
                            buf = sync._build(m, sources, given)
                            dense += m.nbytes
                            key = (plan, rank, k, m.msg.op_index)
                            last = references.get(key)
                            if last is None:
                                references[key] = buf
                                continue
                            before = last.clone()  # what the receiver holds: the last message
                            head, payload = delta_codec.encode(buf, last, m.word, CHUNK)
                            total = delta_codec.header_of(head)[0]
                            coded += head.numel() + total
                            delta_codec.decode(before, head, payload[:total], m.word, CHUNK)
                            found[plan]["verified"] &= torch.equal(before, buf)
                found[plan]["dense"].append(dense)
                found[plan]["delta"].append(coded if step else dense)
        layers_bf16, layers_fp8 = found["bf16"]["layer_bytes"], found["fp8"]["layer_bytes"]
        edges = found["bf16"]["dense"][0] - layers_bf16  # embed, final norm, lm head: bf16 in both
        out["lr"][str(lr)] = {**found, "changed_fraction": changed,
                              "layers_fp8_of_bf16": layers_fp8 / layers_bf16,
                              # the whole 80-layer model: its edges once, its layers 80 / --layers times
                              "fp8_of_bf16_80_layers": (edges + layers_fp8 * 80 / layers) /
                                                       (edges + layers_bf16 * 80 / layers),
                              "delta_of_dense": [d / found["bf16"]["dense"][0] for d in found["bf16"]["delta"][1:]],
                              "fp8_of_bf16": found["fp8"]["dense"][0] / found["bf16"]["dense"][0],
                              "fp8_delta_of_bf16": [d / found["bf16"]["dense"][0] for d in found["fp8"]["delta"][1:]]}
    return out


def _piece_bytes(m, piece, quant) -> int:
    """Bytes a piece takes in its message (FP8: its codes and the scales it carries)."""
    return piece.nbytes if quant is None else quant.h * quant.w + 4 * len(quant.carried)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for sync_codecs.json")
    parser.add_argument("--quick", action="store_true", help="small sizes (a CPU smoke test)")
    parser.add_argument("--sizes", default="64,256,1024", help="message sizes, MiB")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--layers", type=int, default=2, help="layers of the 70B-shaped actor")
    parser.add_argument("--steps", type=int, default=3, help="training steps after the first (full) sync")
    parser.add_argument("--lrs", default="1e-6,1e-5")
    args = parser.parse_args(argv)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    sizes = [int(x) * MiB for x in args.sizes.split(",")]
    warmup, repeats, layers, steps = args.warmup, args.repeats, args.layers, args.steps
    if args.quick:
        sizes, warmup, repeats, layers, steps = [MiB], 0, 1, 1, 2
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    started = time.perf_counter()
    bound = ceiling(device, max(sizes), warmup, repeats)
    nominal = next((v for k, v in NOMINAL.items() if k in name), None)
    result = {"name": "sync_codecs", "device": name, "torch": torch.__version__, "ceiling_GBps": bound / 1e9,
              "nominal_GBps": nominal / 1e9 if nominal else None,
              "kernels": kernels(device, sizes, (0.001, 0.01, 0.1), warmup, repeats, bound),
              "fp8_linear": fp8_linear(device),
              "sync_bytes": sync_bytes(device, layers, steps, [float(x) for x in args.lrs.split(",")], args.quick)}
    big = [k for k in result["kernels"] if k["message_MiB"] >= 64]
    result["targets"] = {
        "kernels_at_80pct_of_ceiling": all(k["of_ceiling"] >= 0.8 for k in big) if big else None,
        "fp8_at_most_0.55x_bf16": all(v["fp8_of_bf16_80_layers"] <= 0.55 for v in result["sync_bytes"]["lr"].values()),
        "verified": all(v[p]["verified"] for v in result["sync_bytes"]["lr"].values() for p in ("bf16", "fp8")),
        "decode_exact": all(k.get("exact", True) for k in result["kernels"])}
    result["seconds"] = time.perf_counter() - started
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "sync_codecs.json"), "w") as handle:
            json.dump(result, handle, indent=1)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Shared pieces of the multi-GPU scripts (correctness, reshard, weight_sync).

Launched by torchrun, one process per GPU (rank r drives GPU r, as the runtime expects),
NCCL on CUDA or gloo on CPU (`--backend gloo --device cpu` checks the scripts here).

Reference values: every element of every tensor is a hash of (seed, model-stage tag,
tensor name, global linear index), computed on the rank's own device box by box. So a
rank builds exactly its own shards, and checks its shards after a transition against
freshly computed values, without any rank ever holding a whole tensor and without a
gather. Comparison is byte for byte (integer views, NaN-proof).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import zlib
from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as dist

# Llama-3.1-8B (examples/ppo-8b.nir's `model actor`); "tiny" keeps its GQA ratio for CPU checks.
SHAPES = {
    "8b": dict(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256),
    "small": dict(layers=4, hidden=256, heads=8, kv_heads=4, ffn=512, vocab=1024),
    "tiny": dict(layers=4, hidden=64, heads=8, kv_heads=2, ffn=128, vocab=256),
}
PAPER_4_TO_8_S = 2.45  # Nereus paper, Table 4: 8B actor/critic, 4 -> 8 GPUs


# -- process group ---------------------------------------------------------------------

def add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", choices=("nccl", "gloo"), default=None,
                        help="default: nccl when CUDA is available, else gloo")
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None,
                        help="where the state lives (default: cuda with nccl, cpu with gloo)")
    parser.add_argument("--quick", action="store_true", help="fewer/smaller cases (CPU checks, tight budgets)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-out", default=None, help="also write the final JSON object here (rank 0)")
    parser.add_argument("--timeout-s", type=float, default=180.0, help="process-group timeout")


class Env:
    """This process's place in the job: rank, world, device, and a gloo group for
    control and timing (so timing never waits on the data backend's queues)."""

    def __init__(self, args):
        backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
        kind = args.device or ("cuda" if backend == "nccl" else "cpu")
        if backend == "nccl" and kind != "cuda":
            raise SystemExit("--backend nccl needs --device cuda")
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if kind == "cuda":
            torch.cuda.set_device(local)
            self.device = torch.device("cuda", local)
        else:
            self.device = torch.device("cpu")
            torch.set_num_threads(1)
        timeout = timedelta(seconds=args.timeout_s)
        options = dict(backend=backend, timeout=timeout)
        if kind == "cuda":
            options["device_id"] = self.device  # eager NCCL init: the communicator exists before any p2p
        dist.init_process_group(**options)
        self.backend = backend
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.ctrl = dist.new_group(backend="gloo", timeout=timeout)
        self.started = time.time()
        # batch_isend_irecv on NCCL: its first use in a group must involve every rank;
        # a collective first makes that hold whatever the first transition sends.
        warm = torch.ones(1, device=self.device)
        dist.all_reduce(warm)
        self.sync()

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        self.sync()
        dist.barrier(group=self.ctrl)

    def slowest(self, seconds: float) -> float:
        t = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.ctrl)
        return float(t.item())

    def total(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.ctrl)
        return float(t.item())

    def all_true(self, flag: bool) -> bool:
        t = torch.tensor([1 if flag else 0])
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.ctrl)
        return bool(t.item())

    def timed(self, fn: Callable):
        """(result, seconds of the slowest rank), barrier to barrier, device synchronised."""
        self.barrier()
        t0 = time.perf_counter()
        out = fn()
        self.sync()
        return out, self.slowest(time.perf_counter() - t0)

    def timed_median(self, fn: Callable, repeats: int) -> tuple:
        """(the last call's result, the median of `repeats` warm calls, their times, the
        first call's time: cold), every call timed by `timed`; each result is dropped
        before the next call (two would not fit beside each other in the large cases)."""
        first, cold = self.timed(fn)
        del first
        times, out = [], None
        for _ in range(repeats):
            out = None
            out, seconds = self.timed(fn)
            times.append(seconds)
        return out, statistics.median(times), times, cold

    def log(self, text: str) -> None:
        if self.rank == 0:
            print(f"[{time.time() - self.started:7.1f}s] {text}", flush=True)

    def gpu_mem_bytes(self) -> int:
        if self.cuda:
            return torch.cuda.get_device_properties(self.device).total_memory
        return 141 * 10**9  # a CPU check plans as if on H200s; tiny models use a sliver

    def finish(self, result: dict, json_out: Optional[str]) -> None:
        """Print the one JSON object (rank 0, last stdout line) and leave the group."""
        self.barrier()
        if self.rank == 0:
            text = json.dumps(result)
            if json_out:
                os.makedirs(os.path.dirname(os.path.abspath(json_out)), exist_ok=True)
                with open(json_out, "w") as f:
                    f.write(text + "\n")
            print(text, flush=True)
        dist.destroy_process_group()


def whole_program(rt, target: str) -> dict:
    """The whole JSON program of `rt`'s move from its current plan to `target`, compiled on
    this rank (`Runtime.compile` gives this rank's part only): what the scripts replay for
    the verifier's peak bytes and where they pick a fault point every rank agrees on."""
    from nereus.backends.json_program import program_json
    from nereus.passes import compile_transition

    return program_json(compile_transition(rt.module, rt.plan, target))


def machine() -> dict:
    """What ran: versions and devices (recorded next to every result)."""
    import platform

    out = {"torch": torch.__version__, "python": platform.python_version(),
           "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE")}
    try:
        import triton

        out["triton"] = triton.__version__
    except Exception:  # noqa: BLE001 - triton is optional on CPU
        out["triton"] = None
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
        out["gpu_mem_bytes"] = torch.cuda.get_device_properties(0).total_memory
        version = torch.cuda.nccl.version()
        out["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    from nereus.runtime import packing

    out["pack_backend"] = packing.BACKEND
    return out


# -- .nir sources ----------------------------------------------------------------------

def cluster_source(world: int, mem_bytes: int) -> str:
    return (f"cluster host {{\n  nodes 1\n  gpus_per_node {world}\n"
            f"  gpu {{ mem {mem_bytes // 10**6}MB  flops 989TFLOPS  hbm 4.8TB/s }}\n"
            f"  intra 900GB/s\n  inter 25GB/s\n  host_mem 2TB\n}}\n")


def model_source(shape: dict, layers: Optional[int] = None) -> str:
    s = dict(shape, layers=layers or shape["layers"])
    return (f"model actor = llama {{ layers {s['layers']} hidden {s['hidden']} heads {s['heads']} "
            f"kv_heads {s['kv_heads']} ffn {s['ffn']} vocab {s['vocab']} dtype bf16 }}\n"
            f"model critic = actor {{ head value }}\n")


def plan_source(name: str, placements: dict) -> str:
    """placements: {model-stage: (dp, tp, pp, [gpus])}."""
    lines = [f"plan {name} {{"]
    for ms, (dp, tp, pp, gpus) in placements.items():
        lines.append(f"  {ms} dp {dp} tp {tp} pp {pp} on {', '.join(map(str, gpus))}")
    return "\n".join(lines + ["}"]) + "\n"


# -- reference values ------------------------------------------------------------------

_M31 = 0x7FFFFFFF


def salt_of(seed: int, tag: str, name: str) -> int:
    return zlib.crc32(f"{seed}:{tag}:{name}".encode()) & 0xFFFFF


def box_values(salt: int, box, shape, dtype, device, chunk: int = 1 << 26) -> torch.Tensor:
    """Reference values of one global box of a tensor of `shape`: a hash of each
    element's linear index, in [-128, 128) with step 1/256 (exact in fp32). Computed in
    slabs of dim 0 of at most about `chunk` elements, so temporaries stay small."""
    if not shape:
        return torch.tensor(float(salt % 97), dtype=dtype, device=device)
    sizes = [hi - lo for lo, hi in box]
    out = torch.empty(sizes, dtype=dtype, device=device)
    inner = 1
    for n in sizes[1:]:
        inner *= n
    step = max(1, chunk // max(1, inner))
    for start in range(box[0][0], box[0][1], step):
        stop = min(start + step, box[0][1])
        part = [(start, stop)] + [tuple(b) for b in box[1:]]
        idx = torch.zeros([hi - lo for lo, hi in part], dtype=torch.int64, device=device)
        stride = 1
        for d in reversed(range(len(shape))):
            lo, hi = part[d]
            view = [1] * len(shape)
            view[d] = hi - lo
            idx += torch.arange(lo, hi, dtype=torch.int64, device=device).view(view) * stride
            stride *= shape[d]
        x = ((idx + salt) & _M31) * 0x5BD1E995 & _M31  # products stay below 2^62
        del idx
        x ^= x >> 13
        x = (x * 0x27D4EB2D) & _M31
        x ^= x >> 15
        out[start - box[0][0]: stop - box[0][0]] = ((x % 65521) - 32760).to(torch.float32).mul_(1 / 256).to(dtype)
    return out


def shard_values(salt: int, boxes, shape, dtype, device) -> torch.Tensor:
    """A local shard (its boxes stacked along dim 0, the runtime's contract)."""
    parts = [box_values(salt, b, shape, dtype, device) for b in boxes]
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def my_shards(units: list, rank: int) -> dict:
    """{tensor: boxes} of this rank's shards in a layout (UNIT dicts); {} if it holds none."""
    unit = next((u for u in units if rank in u["gpus"]), None)
    if unit is None:
        return {}
    return {s["tensor"]: s["boxes"] for s in unit["shards"] if s["gpu"] == rank}


def build_local(units: list, rank: int, specs: dict, seed: int, tag: str, device,
                names: Optional[Callable[[str], bool]] = None, step: Optional[int] = None) -> dict:
    """This rank's shards of a layout, filled with reference values (and the Adam step)."""
    out = {}
    for name, boxes in my_shards(units, rank).items():
        if names is None or names(name):
            shape, dtype = specs[name]
            out[name] = shard_values(salt_of(seed, tag, name), boxes, shape, dtype, device)
    if out and step is not None:
        out[step_key(units)] = torch.tensor(step, dtype=torch.int64)
    return out


def step_key(units: list) -> str:
    return units[0]["model_stage"].split(".")[0] + "/#step"


def check_local(local: dict, units: list, rank: int, specs: dict, seed: int, tag: str, device,
                names: Optional[Callable[[str], bool]] = None, step: Optional[int] = None) -> list:
    """Mismatches (empty when right) between this rank's shards and the reference
    slices of the layout: wrong name set, wrong bytes, wrong step counter."""
    expected = {n: b for n, b in my_shards(units, rank).items() if names is None or names(n)}
    bad = []
    got = {n for n in local if not n.endswith("#step")}
    if got != set(expected):
        bad.append(f"names: {len(got)} held, {len(expected)} expected, e.g. {sorted(got ^ set(expected))[:2]}")
    for name in sorted(set(expected) & got):
        shape, dtype = specs[name]
        if not same_bytes(local[name], shard_values(salt_of(seed, tag, name), expected[name], shape, dtype, device)):
            bad.append(f"bytes: {name}")
    if step is not None and expected:
        key = step_key(units)
        if key not in local or int(local[key]) != step:
            bad.append(f"step: {key}")
    return bad


# -- bytes -----------------------------------------------------------------------------

def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def incoming_bytes(before: list, after: list, specs: dict) -> dict:
    """{gpu: bytes of its new shards that it did not hold before} (same model-stage):
    what must reach that GPU whatever the algorithm. Sum = bytes that change owner."""
    from nereus.runtime.boxes import as_box, box_numel, intersect

    held: dict = {}
    for unit in before:
        for s in unit["shards"]:
            held.setdefault((s["gpu"], s["tensor"]), []).extend(as_box(b) for b in s["boxes"])
    out: dict = {}
    for unit in after:
        for s in unit["shards"]:
            if s["tensor"] not in specs:
                continue
            size = element_size(specs[s["tensor"]][1])
            for raw in s["boxes"]:
                box = as_box(raw)
                have = sum(box_numel(x) for h in held.get((s["gpu"], s["tensor"]), ()) if (x := intersect(box, h)))
                out[s["gpu"]] = out.get(s["gpu"], 0) + (box_numel(box) - have) * size
    return out


def layout_bytes(units: list, specs: dict) -> dict:
    """{gpu: bytes of the shards a layout puts on it}."""
    from nereus.runtime.boxes import as_box, box_numel

    out: dict = {}
    for unit in units:
        for s in unit["shards"]:
            if s["tensor"] in specs:
                n = sum(box_numel(as_box(b)) for b in s["boxes"])
                out[s["gpu"]] = out.get(s["gpu"], 0) + n * element_size(specs[s["tensor"]][1])
    return out


def specs_bytes(specs: dict) -> int:
    return sum(torch.Size(shape).numel() * element_size(dtype) for shape, dtype in specs.values())


# -- link bandwidth --------------------------------------------------------------------

def measure_bandwidth(env: Env, nbytes: int, repeats: int = 5) -> dict:
    """Measured in this run, over the data backend:
    p2p_GBps: one large send from rank 0 to rank 1 while the others wait (one direction);
    ring_GBps: every rank sends `nbytes` to rank+1 and receives from rank-1 at once
    (per-GPU rate with every link busy, the relevant rate for parallel transfers)."""
    if env.world < 2:
        return {"p2p_GBps": None, "ring_GBps": None, "bandwidth_bytes": nbytes}
    buf = torch.empty(nbytes, dtype=torch.uint8, device=env.device)
    inbox = torch.empty_like(buf)

    def pair():
        if env.rank == 0:
            dist.send(buf, 1)
        elif env.rank == 1:
            dist.recv(inbox, 0)

    def ring():
        ops = [dist.P2POp(dist.isend, buf, (env.rank + 1) % env.world),
               dist.P2POp(dist.irecv, inbox, (env.rank - 1) % env.world)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()

    out = {"bandwidth_bytes": nbytes}
    for key, fn in (("p2p", pair), ("ring", ring)):
        fn()  # warm-up: creates the communicators
        times = [env.timed(fn)[1] for _ in range(repeats)]
        out[f"{key}_GBps"] = nbytes / statistics.median(times) / 1e9
        out[f"{key}_times_s"] = times
    del buf, inbox
    return out



def link_bandwidth(env: Env, mib: Optional[int]) -> dict:
    """`measure_bandwidth` with the scripts' default size (`--bandwidth-mib`: 1 GiB on GPU,
    4 MiB on CPU), logged."""
    mib = mib or (1024 if env.cuda else 4)
    bw = measure_bandwidth(env, mib << 20)
    env.log(f"bandwidth: p2p {bw['p2p_GBps']:.1f} GB/s, ring {bw['ring_GBps']:.1f} GB/s per GPU ({mib} MiB)")
    return bw


def selected_cases(parser: argparse.ArgumentParser, requested: Optional[str], known: list, world: int) -> list:
    """The `--cases` list (comma-separated; default every known case), each checked."""
    names = [c for c in (requested or ",".join(known)).split(",") if c]
    for case in names:
        if case not in known:
            # exit cleanly: a process leaving with its gloo groups alive aborts (SIGABRT)
            if dist.is_initialized():
                dist.destroy_process_group()
            parser.error(f"unknown case {case} for {world} ranks; known: {known}")
    return names

def bounds(incoming: dict, bw: dict) -> dict:
    """bound_s: bytes that change owner / measured P2P bandwidth (the issue's bound, as
    if the bytes crossed one link after another); bound_parallel_s: the busiest GPU's
    incoming bytes / the per-GPU rate with every link busy (transfers in parallel)."""
    total = sum(incoming.values())
    busiest = max(incoming.values(), default=0)
    p2p, ring = bw.get("p2p_GBps"), bw.get("ring_GBps")
    return {"bytes_owner_change": total, "bytes_busiest_gpu_in": busiest,
            "bound_s": total / (p2p * 1e9) if p2p else None,
            "bound_parallel_s": busiest / (ring * 1e9) if ring else None}


def free_memory(env: Env) -> None:
    import gc

    gc.collect()
    if env.cuda:
        torch.cuda.empty_cache()


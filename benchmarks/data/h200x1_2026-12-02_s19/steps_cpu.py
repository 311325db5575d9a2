"""The lowering-ahead thread's host work for the 6-layer train-ep2-tp2 pair A -> B, rank 0,
on a CPU (no GPU, nothing beside it): the lowering, the stream variants' classes, and each
replay's build (tables only; the Triton backend forced under TRITON_INTERPRET=1, so the
replays build as on CUDA; their upload is a CPU copy). Session 19 set these beside the GPU
step log, whose steps ran beside the job's registering.

    cd benchmarks/data/h200x1_2026-12-02_s19
    TRITON_INTERPRET=1 NEREUS_PACK_BACKEND=triton PYTHONPATH=../../.. python3 steps_cpu.py [LAYERS]

Last stdout line: one JSON object (seconds)."""
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "multi_gpu"))
import torch  # noqa: E402

import moe_reshard as mr  # noqa: E402
import nereus.ir as ir  # noqa: E402
from nereus.backends.rank_json import canonical_json  # noqa: E402
from nereus.runtime import packing, prepare, replay, streams  # noqa: E402
from nereus.runtime.ahead_steps import lower_part  # noqa: E402
from nereus.runtime.distribute import _lower_own_part  # noqa: E402
from nereus.runtime.execution_plan import plan_for  # noqa: E402
from nereus.runtime.executor import TORCH_DTYPES  # noqa: E402

layers = int(sys.argv[1]) if len(sys.argv) > 1 else 6
module = ir.parse_source(mr.module_source("train-ep2-tp2", 2, 141 * 10**9, mr.SHAPES["30b-a3b"], layers), "t.nir")
packer = packing.kernels().default_packer()
out = {"layers": layers}
t = time.perf_counter()
_, part = _lower_own_part(module, "A", "B", 0)
facts, prog = lower_part(canonical_json(part), 0, 1 << 20)
out["lower_and_plan_s"] = time.perf_counter() - t
plan = plan_for(prog, streams.CHUNK_BYTES)
t = time.perf_counter()
calls = []
for kind, views, on_host in prepare.stream_views(prog, TORCH_DTYPES, facts.offloaded):
    for segments in streams.chunk_views(views, streams.CHUNK_BYTES):
        if on_host or streams.fused(segments):
            calls.append((kind, segments, packing.layout([v.numel() * v.element_size() for v in segments])[0]))
out["stream_classes_s"] = time.perf_counter() - t
out["stream_variants"] = len(packer.launch_classes(calls))
replay.packer_for(torch.device("cpu"))  # Triton's import, not in the first replay's time
builds = []
steps = replay.warm_steps(prog, plan, torch.device("cpu"), streams.DEPTH, facts.offloaded)
while True:
    t = time.perf_counter()
    if next(steps, None) is None:
        break
    builds.append(time.perf_counter() - t)
out["replay_builds_s"] = builds
print(json.dumps(out))

"""What the memory tests share (test_memory_model.py on CPU, test_memory_model_cuda.py on a
GPU): plans that stage or offload on full GPUs, the memory model's bound on a round's
message buffers re-derived from a JSON program, and the runtime's accounting of them.

`model_round_buffers(program)` is an independent re-derivation of the verifier's
transient term (docs/program.md, "Memory"): per (round, GPU), the sum over the round's
sends of what each segment costs there under the program's `memory_model`, a segment's
source counted as host memory when its before-unit is offloaded or was staged out in an
earlier round.
"""

from __future__ import annotations

import pathlib
from collections import defaultdict

from nereus.passes.memory_model import FIELD, V1_DEFAULT, destination_bytes, source_bytes

ROOT = pathlib.Path(__file__).resolve().parents[2]
SWAP = ROOT / "tests" / "data" / "swap-staging.nir"  # A -> B: a cycle on full GPUs, broken by staging

# ref moves into host memory (A -> B: received into an offloaded unit) and out of it on
# full GPUs (B -> C: sent out of one; GPU 0 receives the training state meanwhile)
OFFLOAD = """
cluster two {
  nodes 1  gpus_per_node 2
  gpu { mem 1900KB  flops 1TFLOPS  hbm 100GB/s }
  intra 10GB/s  inter 1GB/s  host_mem 1GB
}
model actor = llama { layers 2 hidden 64 heads 4 kv_heads 2 ffn 128 vocab 64 }
model ref = actor
workload w { batch 1 prompt 1 response 1 microbatch 1  inference: ref  training: actor }
plan A { ref.inference dp 1 tp 2 on 0, 1          actor.training dp 1 tp 2 on 0, 1 }
plan B { ref.inference dp 1 tp 1 on 0 offload     actor.training dp 1 tp 2 on 0, 1 }
plan C { ref.inference dp 1 tp 1 on 1             actor.training dp 1 tp 1 on 0 }
"""
OFFLOAD_CHAIN = (("A", "B"), ("B", "C"))

ODD = ROOT / "tests" / "data" / "swap-odd.nir"  # the swap with odd-sized segments: padding, cuts mid-piece


def case_programs(memory_model: str, swap=None) -> dict:
    """{case: JSON program, version 1} compiled for `memory_model` (GPUs sized to the moved
    state): "swap" (`swap`, a Module, or SWAP's), the OFFLOAD chain's moves, "odd"."""
    import nereus.ir as ir
    from nereus.backends.json_program import program_json
    from nereus.passes import compile_transition

    def compiled(module, source, target):
        return program_json(compile_transition(module, source, target, memory_model=memory_model, check_fit=False),
                            version=1)

    out = {"swap": compiled(swap or ir.parse_file(str(SWAP)), "A", "B")}
    offload = ir.parse_source(OFFLOAD, "offload.nir")
    for source, target in OFFLOAD_CHAIN:
        out[f"offload {source}->{target}"] = compiled(offload, source, target)
    out["odd"] = compiled(ir.parse_file(str(ODD)), "A", "B")
    return out


def model_round_buffers(program: dict) -> dict:
    """{(round, gpu): bytes} the program's memory model charges for the round's sends on
    that GPU (module docstring); `program`: version 1, segments naming their units."""
    kind = program.get(FIELD, V1_DEFAULT)
    host = {unit["id"] for unit in program["units"]["before"] if unit.get("offload")}
    size = {t["name"]: t["dtype"] for t in program["tensors"]}
    element = {"bf16": 2, "fp16": 2, "fp32": 4}
    out: dict = defaultdict(int)
    for k, rnd in enumerate(program["rounds"]):
        for op in rnd["ops"]:
            if op["op"] != "send":
                continue
            for seg in op["segments"]:
                n = element[size[seg["tensor"]]]
                for lo, hi in seg["box"]:
                    n *= hi - lo
                out[(k, op["src"])] += source_bytes(kind, n, seg["src_unit"] in host)
                out[(k, op["dst"])] += destination_bytes(kind, n)
        host.update(op["unit"] for op in rnd["ops"] if op["op"] == "stage_out")
    return dict(out)


def host_units(program: dict) -> tuple[set, set, list]:
    """(offloaded before-units, offloaded after-units, per round the before-units staged
    out in an earlier round)."""
    before = {u["id"] for u in program["units"]["before"] if u.get("offload")}
    after = {u["id"] for u in program["units"]["after"] if u.get("offload")}
    staged, per_round = set(), []
    for rnd in program["rounds"]:
        per_round.append(set(staged))
        staged.update(op["unit"] for op in rnd["ops"] if op["op"] == "stage_out")
    return before, after, per_round


def accounted_round_buffers(program: dict, depth: int, chunk_bytes: int) -> dict:
    """{(round, gpu): bytes} the runtime counts for the round's messages on every rank
    (nereus.runtime.wires.round_buffer_bytes over its rank program's execution plan)."""
    from nereus.runtime.execution_plan import build_plan
    from nereus.runtime.program import rank_program
    from nereus.runtime.wires import round_buffer_bytes

    before, after, staged = host_units(program)
    out = {}
    for gpu in (g["id"] for g in program["gpus"]):
        prog = rank_program(program, gpu)
        plan = build_plan(prog, chunk_bytes)
        for work, planned in zip(prog.rounds, plan.rounds):
            n = round_buffer_bytes(planned, work, depth, frozenset(before | staged[work.index]), frozenset(after))
            if n:
                out[(work.index, gpu)] = n
    return out

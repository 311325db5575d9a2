"""The cost model's per-piece host term: `pieces_per_gpu` counts, from the compiled
program alone, the pieces the runtime's lowering gives each GPU (sent, received and
copied; a piece of a v2 range once per tensor it moves: the executor views each), on
expert-parallel and dense transitions; `piece_s` and `fixed_s` add to the
predicted time, and a Calibration's measured NVLink bandwidth replaces the cluster's."""

from __future__ import annotations

import pytest

import nereus.ir as ir
from nereus.backends.json_program import program_json
from nereus.passes import compile_transition
from nereus.passes.cost import Calibration, estimate, pieces_per_gpu
from nereus.runtime.program import rank_program

CLUSTER = ("cluster c { nodes 1 gpus_per_node 4 gpu { mem 8GB flops 1TFLOPS hbm 100GB/s } intra 10GB/s "
           "inter 1GB/s host_mem 16GB }\n")
MOE = ("model actor = qwen3_moe { layers 3 hidden 16 heads 4 kv_heads 2 head_dim 8 ffn 32 vocab 32 dtype bf16 "
       "experts 8 experts_per_token 2 expert_ffn 8 }\n")
DENSE = "model actor = llama { layers 3 hidden 32 heads 4 kv_heads 2 ffn 64 vocab 64 dtype bf16 }\n"


def _compiled(model: str, stage: str, before: str, after: str):
    module = ir.parse_source(CLUSTER + model + f"workload w {{ batch 4 prompt 4 response 4 microbatch 1 "
                             f"{stage}: actor }}\nplan A {{ actor.{stage} {before} }}\n"
                             f"plan B {{ actor.{stage} {after} }}\n", "pieces.nir")
    return compile_transition(module, "A", "B")


CASES = [
    (MOE, "training", "dp 1 ep 2 on 0..1", "dp 2 on 0..1"),
    (MOE, "training", "dp 1 ep 2 on 0..1", "dp 1 tp 2 on 0..1"),
    (MOE, "generation", "dp 1 ep 4 on 0..3", "dp 2 tp 2 on 0..3"),
    (MOE, "generation", "dp 1 tp 2 on 0..1", "dp 1 ep 2 tp 2 on 0..3"),
    (DENSE, "training", "dp 1 tp 1 on 0", "dp 1 tp 2 on 0..1"),
    (DENSE, "generation", "dp 1 tp 2 pp 2 on 0..3", "dp 2 tp 2 on 0..3"),
]


@pytest.mark.parametrize("model,stage,before,after", CASES)
def test_pieces_per_gpu_match_the_runtime_lowering(model, stage, before, after):
    compiled = _compiled(model, stage, before, after)
    predicted = pieces_per_gpu(compiled.program)
    program = program_json(compiled)
    for gpu in range(4):
        prog = rank_program(program, gpu)
        for k, work in enumerate(prog.rounds):
            lowered = sum(p.count for m in work.sends + work.recvs for p in m.pieces) + \
                sum(p.count for p in work.copies)
            assert predicted[k].get(gpu, 0) == lowered, (gpu, k)


def test_the_piece_term_and_a_calibration_add_to_the_prediction():
    compiled = _compiled(MOE, "training", "dp 1 ep 2 on 0..1", "dp 2 on 0..1")
    base = estimate(compiled.program, message_latency_s=0.0, count_pieces=True)
    busiest = max(pieces_per_gpu(compiled.program)[0].values())
    assert busiest > 0 and base.pieces == busiest
    timed = estimate(compiled.program, message_latency_s=0.0, piece_s=1e-5, fixed_s=0.002)
    assert timed.seconds == pytest.approx(base.seconds + 1e-5 * busiest + 0.002)
    fast = Calibration(intra_bytes_per_s=20e9, piece_s=1e-5, fixed_s=0.002).estimate(compiled.program)
    assert fast.seconds == pytest.approx(base.seconds / 2 + 1e-5 * busiest + 0.002)


def test_the_cost_model_joins_parts_as_the_runtime_does():
    # the compiler cannot import the runtime: its JOIN_PARTS mirrors the lowering's
    import nereus.passes.cost as cost
    import nereus.runtime.program as lowering

    assert cost.JOIN_PARTS == lowering.JOIN_PARTS


@pytest.mark.parametrize("model,stage,before,after", CASES[:3])
def test_pieces_match_with_two_part_joins_on(monkeypatch, model, stage, before, after):
    import nereus.passes.cost as cost
    import nereus.runtime.program as lowering

    monkeypatch.setattr(cost, "JOIN_PARTS", True)
    monkeypatch.setattr(lowering, "JOIN_PARTS", True)
    test_pieces_per_gpu_match_the_runtime_lowering(model, stage, before, after)

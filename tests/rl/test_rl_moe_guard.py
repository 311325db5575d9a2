"""The RL loop refuses what it cannot run yet: a MoE model and a placement with ep > 1
(the compiler accepts both), with located errors."""

import pytest

import nereus.ir as ir
from nereus.rl.checks import check_models, check_placement

TEXT = ("cluster c { nodes 1 gpus_per_node 4 gpu { mem 80GB flops 1TFLOPS hbm 1TB/s } intra 1GB/s inter 1GB/s "
        "host_mem 1TB }\nmodel actor = qwen3_moe { layers 2 hidden 64 heads 4 kv_heads 2 ffn 64 vocab 256 "
        "experts 4 experts_per_token 2 expert_ffn 32 }\n"
        "workload w { batch 4 prompt 8 response 8 microbatch 1 training: actor }\n"
        "plan A { actor.training dp 1 ep 4 on 0..3 }\n")


def test_moe_model_and_ep_are_refused_by_the_loop():
    module = ir.parse_source(TEXT, "t.nir")
    with pytest.raises(ir.SemanticError, match="no MoE forward yet") as caught:
        check_models(module)
    assert caught.value.loc.line == 2
    with pytest.raises(ir.SemanticError, match=r"does not run expert parallelism \(ep 4\)") as caught:
        check_placement(module.plan("A").placement("actor.training"), 4)
    assert (caught.value.loc.line, caught.value.loc.column) == (4, 33)

"""The RL loop's pre-launch checks accept a MoE model and expert-parallel placements (the
loop runs them: tests/rl/test_moe_transitions.py), and count an EP rank as a
data-parallel shard when they check that every shard gets rows."""

import pytest

import nereus.ir as ir
from nereus.rl.checks import check_models, check_placement, check_replicas

TEXT = ("cluster c {{ nodes 1 gpus_per_node 4 gpu {{ mem 80GB flops 1TFLOPS hbm 1TB/s }} intra 1GB/s inter 1GB/s "
        "host_mem 1TB }}\nmodel actor = qwen3_moe {{ layers 2 hidden 64 heads 4 kv_heads 2 ffn 64 vocab 256 "
        "experts 4 experts_per_token 2 expert_ffn 32 }}\n"
        "workload w {{ batch {batch} prompt 8 response 8 microbatch 1 training: actor }}\n"
        "plan A {{ actor.training dp 1 ep 4 on 0..3 }}\n")


def test_moe_model_and_ep_placements_pass_the_loop_checks():
    module = ir.parse_source(TEXT.format(batch=8), "t.nir")
    check_models(module)
    check_placement(module.plan("A").placement("actor.training"), 4)
    check_replicas(module, minibatches=2)  # 4 rows per minibatch for dp 1 x ep 4 shards


def test_every_ep_rank_needs_rows():
    module = ir.parse_source(TEXT.format(batch=4), "t.nir")
    with pytest.raises(ir.SemanticError, match=r"dp 1 × ep 4 data-parallel shards but a minibatch has 2 rows") as caught:
        check_replicas(module, minibatches=2)
    assert caught.value.loc.line == 4 and "dp·ep <= 2" in caught.value.hint


def test_the_vllm_engine_refuses_a_moe_actor_at_the_model():
    from nereus.rl.engine import check_vllm_plans

    module = ir.parse_source(TEXT.format(batch=8), "t.nir")
    for cuda in (True, False):
        with pytest.raises(ir.SemanticError, match="does not run the mixture-of-experts actor") as caught:
            check_vllm_plans(module, cuda=cuda)
        assert caught.value.loc.line == 2


def test_the_restart_baseline_refuses_expert_parallel_plans():
    from nereus.rl.restart import RestartRuntime

    module = ir.parse_source(TEXT.format(batch=8), "t.nir")
    with pytest.raises(ir.SemanticError, match="restart baseline does not lay out expert parallelism") as caught:
        RestartRuntime(module, "A")
    assert caught.value.loc.line == 4

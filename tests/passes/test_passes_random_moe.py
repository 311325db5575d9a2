"""Hypothesis: random plan pairs of a small Qwen3-MoE with ep, tp, pp and dp changes
(EP <-> TP/DP/PP, reordered and moved GPU sets, training state and a generation copy,
training with zero 1/3 when its ep is 1, so ZeRO <-> EP changes too) compile, verify, and
send exactly the bytes whose owner changes."""

from dataclasses import replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from builders import assert_moves_the_lower_bound, cluster, module, place, workload
from nereus.ir.model import Model


def _moe(name: str, layers: int, experts: int, kv: int) -> Model:
    return Model(name, "qwen3_moe", layers, 16, 4, kv, 32, 32, "bf16", qk_norm=True, experts=experts,
                 experts_per_token=2, expert_ffn=8, norm_topk_prob=True)


def _placement(draw, name, layers, experts, total):
    while True:
        tp = draw(st.sampled_from([1, 2, 4]))
        ep = draw(st.sampled_from([e for e in (1, 2, 4) if experts % e == 0]))
        pp = draw(st.integers(1, min(layers, 3)))
        if tp * ep * pp <= total:
            break
    dp = draw(st.integers(1, max(1, total // (tp * ep * pp))))
    gpus = draw(st.permutations(range(total)))[: dp * tp * ep * pp]
    # zero needs ep 1 (validation refuses zero with expert parallelism)
    zero = draw(st.sampled_from([0, 1, 3])) if ep == 1 and name.endswith(".training") else 0
    return replace(place(name, dp, tp, pp * ep, gpus), pp=pp, ep=ep, zero=zero)


@st.composite
def moe_plan_pairs(draw):
    nodes = draw(st.integers(1, 2))
    per_node = draw(st.sampled_from([2, 4]))
    layers = draw(st.integers(1, 3))
    experts = draw(st.sampled_from([2, 4, 8]))
    kv = draw(st.sampled_from([1, 2, 4]))
    stages = {"training": ["actor"]}
    if draw(st.booleans()):
        stages["generation"] = ["actor"]
    w = workload(stages)
    total = nodes * per_node
    plans = {p: [_placement(draw, str(ms), layers, experts, total) for ms in w.model_stages()] for p in ("S", "T")}
    return module(cluster(nodes, per_node, 10**9), [_moe("actor", layers, experts, kv)], w, plans)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(moe_plan_pairs())
def test_random_moe_transitions_compile_and_verify(m):
    assert_moves_the_lower_bound(m)

"""One memory model: the controller's `plan_memory` (generation waves off) and the compiler's
feasibility pass (`nereusc check`) give the same worst bytes and the same verdict for random
plans over every key that changes memory: dp, tp, pp, ep, zero 1 and 3, offload, recompute,
microbatch, reordered and partial GPU sets, reserve and host memory."""

from dataclasses import replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nereus.controller.memory import plan_memory
from nereus.ir.gpuset import items_for
from nereus.ir.model import (STAGES, Cluster, GpuSpec, Model, ModelStage, Module, Placement, Plan, Workload)
from nereus.passes.feasibility import check_plan

MIB = 1 << 20


def _models(moe: bool) -> list[Model]:
    if moe:
        actor = Model("actor", "qwen3_moe", 3, 32, 4, 2, 64, 64, "bf16", head_dim=8, qk_norm=True, experts=4,
                      experts_per_token=2, expert_ffn=16, norm_topk_prob=True)
    else:
        actor = Model("actor", "llama", 4, 64, 4, 2, 128, 256, "bf16")
    return [actor, replace(actor, name="critic", head="value")]


def _placement(draw, ms: ModelStage, model: Model, total: int) -> Placement:
    while True:
        tp = draw(st.sampled_from([1, 2, 4]))
        ep = draw(st.sampled_from([e for e in (1, 2, 4) if model.experts % e == 0])) if model.experts else 1
        pp = draw(st.integers(1, 3))
        if tp * ep * pp <= total:
            break
    dp = draw(st.integers(1, total // (tp * ep * pp)))
    gpus = tuple(draw(st.permutations(range(total)))[: dp * tp * ep * pp])
    if draw(st.booleans()):  # in order from 0 (the periodic path) or reordered
        gpus = tuple(range(len(gpus)))
    zero = draw(st.sampled_from([0, 1, 3])) if ms.stage == "training" and ep == 1 else 0
    offload = draw(st.booleans()) and draw(st.booleans())
    return Placement(ms, dp, tp, pp, gpus, items_for(gpus), offload, zero, ep=ep)


@st.composite
def modules(draw):
    moe = draw(st.booleans())
    models = _models(moe)
    nodes, per_node = draw(st.integers(1, 2)), draw(st.sampled_from([2, 4]))
    mem = draw(st.integers(1, 24)) * MIB
    host = draw(st.integers(1, 48)) * MIB
    reserve = draw(st.sampled_from([0.0, 0.05, 0.2]))
    cluster = Cluster("c", nodes, per_node, GpuSpec(mem, 1e15, 1e12), 1e11, 1e10, host, reserve)
    batch = draw(st.sampled_from([4, 8, 12]))
    micro = draw(st.sampled_from([m for m in (1, 2, 4) if batch % m == 0]))
    stages = {"training": ("actor", "critic")}
    if draw(st.booleans()):
        stages["generation"] = ("actor",)
    if draw(st.booleans()):
        stages["inference"] = tuple(draw(st.sampled_from([("actor",), ("critic",), ("actor", "critic")])))
    workload = Workload("w", batch, draw(st.integers(1, 64)), draw(st.integers(1, 96)), micro,
                        tuple((s, stages[s]) for s in STAGES if s in stages),
                        draw(st.sampled_from(["none", "selective", "full"])))
    by_name = {m.name: m for m in models}
    placements = tuple(_placement(draw, ms, by_name[ms.model], cluster.num_gpus) for ms in workload.model_stages())
    return Module(cluster, tuple(models), workload, (Plan("P", None, placements, placements),), ())


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(modules())
def test_plan_memory_is_the_feasibility_pass(module):
    plan = module.plans[0]
    report = check_plan(module, plan)
    got = plan_memory(module, module.workload, plan, allow_waves=False)
    assert got.worst_bytes == report.worst.bytes
    assert got.feasible == report.feasible


def test_the_search_counts_offloaded_units_together_in_host_memory():
    """Each inference unit offloaded alone fits a node's 1.2 GB of host memory (1.1 GB), two do
    not: the search returns a plan the pass accepts, with one of them offloaded."""
    import os

    import nereus.ir as ir
    from nereus.controller.cost_model import CostModel
    from nereus.controller.search import search_plan

    small = ir.parse_file(os.path.join(os.path.dirname(__file__), "small.nir"))
    cluster = replace(small.cluster, gpu=replace(small.cluster.gpu, mem_bytes=6 * 10**9), host_mem_bytes=12 * 10**8)
    module = replace(small, cluster=cluster)
    found = search_plan(module, module.workload, CostModel(module), 8)
    assert [str(p.model_stage) for p in found.plan.placements if p.offload] == ["actor.inference"]
    assert check_plan(replace(module, plans=(found.plan,)), found.plan).feasible
    assert plan_memory(module, module.workload, found.plan).feasible

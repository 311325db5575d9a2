"""Expert parallelism in the compiler: expert tensors as whole boxes on their EP rank,
memory per EP rank, and EP <-> TP transitions that verify and move exactly the bytes
whose owner changes."""

from dataclasses import replace

import pytest

from builders import cluster, module, place, workload
from nereus.backends.json_program import program_json
from nereus.ir.model import Model
from nereus.models import tensor_table
from nereus.passes import compile_transition
from nereus.passes.feasibility import check_plan
from nereus.passes.layout import box_volume, gpu_shards, mesh_positions, rank_boxes
from nereus.passes.verify import verify_program


def moe(name: str = "actor", layers: int = 3, experts: int = 4) -> Model:
    return Model(name, "qwen3_moe", layers, 64, 4, 2, 96, 128, "bf16", qk_norm=True, experts=experts,
                 experts_per_token=2, expert_ffn=32, norm_topk_prob=True)


def ep_place(model_stage: str, dp: int, tp: int, pp: int, ep: int, gpus) -> "Placement":  # noqa: F821
    gpus = tuple(gpus)
    return replace(place(model_stage, dp, tp, pp * ep, gpus), pp=pp, ep=ep)


def _holders(model, placement):
    """{tensor: {gpu: boxes}} of one replica's layout."""
    out: dict = {}
    for r, p, u, gpu in mesh_positions(placement):
        if r:
            continue
        for name, boxes in gpu_shards(model, placement, p, u):
            out.setdefault(name, {})[gpu] = boxes
    return out


def test_experts_whole_on_their_ep_rank():
    model = moe(experts=4)
    placement = ep_place("actor.inference", 1, 1, 1, 2, range(2))
    held = _holders(model, placement)
    for e in range(4):
        owner = e // 2
        for part in ("gate_up", "down"):
            name = f"actor/layers.1.mlp.experts.{e}.{part}.weight"
            assert list(held[name]) == [owner]  # whole, on its EP rank only
            (boxes,) = held[name].values()
            spec = next(s for s in tensor_table(model) if s.name == name.split("/", 1)[1])
            assert sum(box_volume(b) for b in boxes) == spec.numel
    # attention and router: on both EP ranks, whole (tp 1)
    assert set(held["actor/layers.0.attn.qkv.weight"]) == {0, 1}
    assert set(held["actor/layers.0.mlp.router.weight"]) == {0, 1}


def test_tp_inside_an_expert_is_megatron_column_row():
    model = moe(experts=4)
    spec = {s.name: s for s in tensor_table(model)}
    gate_up = spec["layers.0.mlp.experts.3.gate_up.weight"]  # owner of expert 3 with ep 2: rank 1
    down = spec["layers.0.mlp.experts.3.down.weight"]
    # stage rank u = ep_rank * tp + tp_rank; tp 2, ep 2
    assert rank_boxes(gate_up, 2, 2, 0) == () and rank_boxes(gate_up, 2, 2, 1) == ()
    assert rank_boxes(gate_up, 2, 2, 2) == (((0, 16), (0, 64)), ((32, 48), (0, 64)))  # gate rows | up rows
    assert rank_boxes(down, 2, 2, 3) == (((0, 64), (16, 32)),)


def test_union_per_replica_is_whole_for_every_tensor():
    model = moe(experts=4)
    placement = ep_place("actor.training", 1, 2, 1, 2, range(4))
    held = _holders(model, placement)
    specs = {f"actor/{s.name}": s for s in tensor_table(model)}
    for name, spec in specs.items():
        boxes = {b for per_gpu in held[name].values() for b in per_gpu}
        assert sum(box_volume(b) for b in boxes) == spec.numel, name


def test_memory_counts_experts_per_ep_rank():
    c = cluster(1, 4, mem=10**12)
    w = workload({"training": ["actor"]})
    model = moe(experts=4)
    m = module(c, [model], w, {"EP": [ep_place("actor.training", 1, 1, 1, 4, range(4))],
                               "DP": [place("actor.training", 4, 1, 1, range(4))]})
    ep, dp = check_plan(m, "EP"), check_plan(m, "DP")
    expert_params = sum(s.numel for s in tensor_table(model) if s.expert is not None)
    dense_params = sum(s.numel for s in tensor_table(model) if s.expert is None)
    weights = {c.kind: c.bytes for c in ep.worst.contributors}
    # each EP rank: one of four experts per layer, plus everything dense
    assert weights["weights"] == (dense_params + expert_params // 4) * 2
    assert weights["grads"] == weights["weights"]
    assert weights["optimizer"] == (dense_params + expert_params // 4) * 12
    assert weights["dispatch"] == 2 * 32 * 2 * 64 * 2  # 2 * b*s tokens * top-k * hidden * bf16
    dp_weights = {c.kind: c.bytes for c in dp.worst.contributors}["weights"]
    assert dp_weights == (dense_params + expert_params) * 2


TRANSITIONS = {
    # name: (before placement args, after placement args) as (dp, tp, pp, ep, gpus)
    "ep_to_tp": ((1, 1, 1, 4, range(4)), (1, 4, 1, 1, range(4))),
    "tp_to_ep": ((1, 4, 1, 1, range(4)), (1, 1, 1, 4, range(4))),
    "ep_to_dp": ((1, 1, 1, 2, range(2)), (2, 1, 1, 1, range(2))),
    "ep_tp_to_pp": ((1, 2, 1, 2, range(4)), (1, 1, 3, 1, range(3))),
    "pp_ep_to_tp_dp": ((1, 1, 2, 2, range(4)), (2, 2, 1, 1, range(4))),
    "ep_moved": ((1, 1, 1, 2, range(2)), (1, 1, 1, 2, range(4, 6))),
}


def transitions_module(experts: int = 4):
    """Plans `{name}_a` and `{name}_b` of every case of TRANSITIONS, a training and a
    generation model-stage each."""
    c = cluster(2, 4, mem=10**12)
    w = workload({"training": ["actor"], "generation": ["gen"]})
    plans = {}
    for name, (before, after) in TRANSITIONS.items():
        plans[f"{name}_a"] = [ep_place("actor.training", *before), ep_place("gen.generation", *before)]
        plans[f"{name}_b"] = [ep_place("actor.training", *after), ep_place("gen.generation", *after)]
    return module(c, [moe("actor", experts=experts), moe("gen", experts=experts)], w, plans)


@pytest.fixture(scope="module")
def moe_module():
    return transitions_module()


@pytest.mark.parametrize("name", sorted(TRANSITIONS))
def test_ep_transitions_verify_and_move_the_lower_bound(moe_module, name):
    compiled = compile_transition(moe_module, f"{name}_a", f"{name}_b")
    # against the plans: the header's ep units are what the layouts say
    report = verify_program(program_json(compiled), against=moe_module)
    assert report.segments > 0
    cost = compiled.cost
    assert cost.lower_bound > 0
    assert cost.bytes_total - cost.bytes_local == cost.lower_bound


def test_ep_to_tp_bytes_by_hand(moe_module):
    """EP 4 -> TP 4 on the same 4 GPUs, one model-stage: a GPU keeps the slice of its
    own expert that its TP rank needs and receives the TP slices of the other three."""
    compiled = compile_transition(moe_module, "ep_to_tp_a", "ep_to_tp_b")
    model = moe()
    per_expert = sum(s.numel for s in tensor_table(model) if s.expert == 0)  # all layers
    # per GPU: 3 foreign experts x 1/4 of each; dense tensors: attention TP slices are
    # already held whole on every EP rank, so nothing else moves
    expected_elems = 4 * 3 * per_expert // 4
    states = 2 + 12 + 2  # training bf16 + fp32 master/m/v, and generation bf16
    assert compiled.cost.lower_bound == expected_elems * states


def test_generation_ep_ranks_decode_their_share_of_the_batch():
    c = cluster(1, 4, mem=10**12)
    w = workload({"generation": ["actor"]})  # batch 8
    model = moe(experts=4)
    m = module(c, [model], w, {"EP": [ep_place("actor.generation", 1, 1, 1, 4, range(4))],
                               "ONE": [place("actor.generation", 1, 1, 1, [0])]})
    ep = {c.kind: c.bytes for c in check_plan(m, "EP").worst.contributors}
    one = {c.kind: c.bytes for c in check_plan(m, "ONE").worst.contributors}
    assert ep["kv_cache"] * 4 == one["kv_cache"]  # 2 of 8 sequences per EP rank
    assert ep["dispatch"] == 2 * 2 * 2 * 64 * 2 and one["dispatch"] == 2 * 8 * 2 * 64 * 2


@pytest.mark.parametrize("zero", [1, 3])
@pytest.mark.parametrize("zero_first", [True, False])
def test_zero_to_ep_and_back_verify_and_move_the_lower_bound(zero, zero_first):
    """Training with zero (ep 1) <-> ep 2 (zero 0): the sharded side's chunks are cut by
    the EP side's stage ranks, experts whole on their EP rank."""
    c = cluster(2, 4, mem=10**12)
    w = workload({"training": ["actor"]})
    sharded = replace(place("actor.training", 4, 2, 1, range(8)), zero=zero)
    expert_parallel = ep_place("actor.training", 2, 1, 2, 2, [7, 6, 5, 4, 3, 2, 1, 0])
    plans = {"A": [sharded], "B": [expert_parallel]} if zero_first else {"A": [expert_parallel], "B": [sharded]}
    compiled = compile_transition(module(c, [moe(experts=4)], w, plans), "A", "B")
    report = verify_program(program_json(compiled))
    assert report.segments > 0
    cost = compiled.cost
    assert cost.lower_bound > 0
    assert cost.bytes_total - cost.bytes_local == cost.lower_bound

"""The feasibility pass on hand-computed cases (arithmetic written out in each test)."""

import pytest

from nereus.ir.model import Cluster, GpuSpec, Model, ModelStage, Module, Placement, Plan, Workload
from nereus.passes.feasibility import check_plan, resident_bytes_per_gpu

# Small llama: layers 4, hidden 256, heads 8 (head_dim 32), kv_heads 2, ffn 512, vocab 1000.
# Per layer: 2 norms 512 + qkv 384x256 + o 256x256 + gate_up 1024x256 + down 256x512.
# One tp=2 rank of a layer: norms 512 + qkv (128+32+32)x256=49152 + o 32768
#   + gate_up 131072 + down 65536 = 279,040 params; embed / lm_head shard 500x256 = 128,000.
LAYER_TP2 = 279_040
VOCAB_TP2 = 128_000


def module(placements, mem, offload_generation=False, recompute="none"):
    cluster = Cluster("c", 1, 4, GpuSpec(mem, 1e15, 1e12), 1e11, 1e10, 10**12)
    actor = Model("actor", "llama", 4, 256, 8, 2, 512, 1000)
    stages = (("generation", ("actor",)), ("training", ("actor",)))
    workload = Workload("w", 8, 16, 16, 2, stages, recompute)
    plan = Plan("P", None, tuple(placements), tuple(placements))
    return Module(cluster, (actor,), workload, (plan,), ())


def place(ms, dp, tp, pp, offload=False):
    return Placement(ModelStage.parse(ms), dp, tp, pp, (0, 1, 2, 3), (), offload)


TRAIN = place("actor.training", 1, 2, 2)
# GPU 0 = (pp stage 0, tp rank 0): layers 0-1 and the embed shard.
GPU0_PARAMS = 2 * LAYER_TP2 + VOCAB_TP2  # 686,080
GPU0_STATE = 16 * GPU0_PARAMS  # bf16 weights 2 + grads 2 + fp32 master/m/v 12 = 10,977,280
# Activations: s=32, b=2, h=256, a=8: sbh = 16,384; 34 + 5*a*s/h = 39 -> 638,976 / tp 2
# = 319,488 per layer, x 2 layers x 2 microbatches in flight on the first stage (1F1B).
GPU0_ACTIVATIONS = 319_488 * 2 * 2  # 1,277,952
GPU0_TRAINING = GPU0_STATE + GPU0_ACTIVATIONS  # 12,255,232


def test_training_only_fits_exactly_at_the_computed_peak():
    fits = check_plan(module([TRAIN], GPU0_TRAINING), "P")
    assert fits.feasible and fits.worst.gpu == 0 and fits.worst.stage == "training"
    assert fits.worst.bytes == 12_255_232
    kinds = {(c.model_stage, c.kind): c.bytes for c in fits.worst.contributors}
    assert kinds == {("actor.training", "optimizer"): 12 * GPU0_PARAMS,
                     ("actor.training", "weights"): 2 * GPU0_PARAMS,
                     ("actor.training", "grads"): 2 * GPU0_PARAMS,
                     ("actor.training", "activations"): GPU0_ACTIVATIONS}
    over = check_plan(module([TRAIN], GPU0_TRAINING - 1), "P")
    assert not over.feasible and over.headroom_bytes == -1
    # GPUs 0 and 1 (the first pipeline stage) overflow; GPU 2 holds layers 2-3, the final
    # norm and the lm_head: 16 x (558,080 + 256 + 128,000) + activations 319,488 x 2 x 1
    # + fp32 logits 4 x 2 x 32 x 500 = 10,981,376 + 638,976 + 128,000 = 11,748,352.
    assert [(u.gpu, u.stage) for u in over.overflowing] == [(0, "training"), (1, "training")]


def test_generation_kv_cache_and_offload():
    # actor.generation dp 2 tp 2: weights 4 x 279,040 + 2 x 128,000 + final norm 256
    # = 1,372,416 params x 2 B = 2,744,832 B. KV per token: 2 x 4 layers x (kv 2 / tp 2 = 1)
    # x head_dim 32 x 2 B = 512 B; 8 / 2 = 4 sequences x 32 tokens -> 65,536 B;
    # fp32 logits 4 x 4 x 500 = 8,000 B.
    generation_weights = 2_744_832
    generation = GPU0_STATE + generation_weights + 65_536 + 8_000
    placed = check_plan(module([place("actor.generation", 2, 2, 1), TRAIN], 10**9), "P")
    # not offloaded: the generation weights stay resident during training too
    assert placed.worst.stage == "training"
    assert placed.worst.bytes == GPU0_TRAINING + generation_weights
    offloaded = check_plan(module([place("actor.generation", 2, 2, 1, offload=True), TRAIN], 10**9), "P")
    assert offloaded.bytes_on(0, "generation") == generation
    assert offloaded.bytes_on(0, "training") == GPU0_TRAINING
    # GPU 2 holds the last pipeline stage, whose training state is 16 x 256 bytes larger
    # (final norm 256 + lm_head shard instead of the embed shard: same size)
    assert offloaded.worst == max(offloaded.overflowing or [offloaded.worst], key=lambda u: u.bytes)
    assert (offloaded.worst.gpu, offloaded.worst.stage) == (2, "generation")
    assert offloaded.worst.bytes == generation + 16 * 256
    # at the step boundary an offloaded model-stage holds nothing on the GPU
    with_offload = module([place("actor.generation", 2, 2, 1, offload=True), TRAIN], 10**9)
    assert resident_bytes_per_gpu(with_offload, with_offload.plans[0])[0] == GPU0_STATE


@pytest.mark.parametrize("recompute, per_layer", [
    ("selective", 34 * 16_384 // 2),  # 34 sbh / t
    ("full", 2 * 16_384),  # 2 sbh
])
def test_recompute_modes_shrink_activations(recompute, per_layer):
    report = check_plan(module([TRAIN], 10**9, recompute=recompute), "P")
    assert report.bytes_on(0, "training") == GPU0_STATE + per_layer * 2 * 2


def test_kv_heads_replicate_when_tp_exceeds_kv_heads():
    # tp 4 > kv_heads 2: each rank holds q 64 rows + one whole k head 32 + one v head 32.
    report = check_plan(module([place("actor.generation", 1, 4, 1)], 10**9), "P")
    layer = 512 + (64 + 32 + 32) * 256 + 256 * 64 + 256 * 256 + 256 * 128
    params = 4 * layer + 2 * 250 * 256 + 256
    kv = 2 * 4 * 1 * 32 * 2 * 8 * 32  # one KV head per rank; all 8 sequences, 32 tokens
    logits = 4 * 8 * 250
    assert report.worst.bytes == 2 * params + kv + logits


HOST_TIGHT = """
cluster cpu {
  nodes 1  gpus_per_node 2
  gpu { mem 64MB  flops 1TFLOPS  hbm 100GB/s }
  intra 10GB/s  inter 1GB/s  host_mem 100KB
}
model actor = llama { layers 2 hidden 64 heads 4 kv_heads 1 ffn 128 vocab 128 dtype bf16 }
workload grpo {
  batch 4  prompt 8  response 8  microbatch 1
  generation: actor
  training:   actor
}
plan A {
  actor.generation dp 2 on 0, 1
  actor.training   dp 1 tp 2 on 0, 1
}
plan B = A {
  actor.generation dp 2 on 0, 1 offload
}
"""


def test_offloaded_state_must_fit_in_its_nodes_host_memory():
    """An offloaded model-stage waits in host memory: a plan whose offloaded state
    overflows a node's host_mem does not fit (the verifier replays the same bytes and
    rejects every program out of it; the check used to say it fits)."""
    from nereus.ir import parse_source
    from nereus.passes.feasibility import check_plan
    from nereus.passes.infeasible import infeasible_error

    module = parse_source(HOST_TIGHT, "host.nir")
    assert check_plan(module, "A").feasible
    report = check_plan(module, "B")
    assert not report.feasible and not report.overflowing  # the GPUs fit: host memory does not
    node, used = report.host_overflowing[0]
    # two dp replicas of the whole generation weights, both on node 0
    weights = sum(report_bytes for report_bytes in report.host_bytes.values())
    assert node == 0 and used == weights > module.cluster.host_mem_bytes
    error = infeasible_error(module.plan("B"), report)
    assert error.message.startswith("plan B does not fit: node 0 holds ")
    assert "host memory" in error.message and "offload" in error.hint
    assert report.to_json()["host"]["overflowing"] == [{"node": 0, "bytes": used}]


def test_a_near_miss_is_said_with_bytes_that_differ():
    """'GPU 2 needs 2.1 MiB in training but has 2.1 MiB': both rounded to one figure."""
    from nereus.passes.infeasible import _apart

    assert _apart(2_200_000, 2_150_000) == ("2,200,000 B", "2,150,000 B")
    assert _apart(3 << 20, 2 << 20) == ("3.0 MiB", "2.0 MiB")

"""`shard_state_dict` and `register` check what they are given against the model (one
gloo rank): a full tensor of another shape (a transposed weight: as many elements) or
dtype, a local shard of another dtype, a fractional Adam step or one given to a stage
without optimizer state are errors naming the tensor, not shards that fail (or silently
hold wrong values) later."""

from __future__ import annotations

import pytest
import torch

from nereus.ir import NereusError
from nereus.runtime import Runtime

from runtime_helpers import spawn_ok

PLAN = """
cluster c { nodes 1 gpus_per_node 1 gpu { mem 1GB flops 1TFLOPS hbm 100GB/s } intra 10GB/s inter 1GB/s host_mem 8GB }
model actor = llama { layers 1 hidden 32 heads 4 kv_heads 2 ffn 64 vocab 64 dtype bf16 }
workload w { batch 2 prompt 4 response 4 microbatch 1 generation: actor training: actor }
plan A { actor.generation dp 1 on 0  actor.training dp 1 on 0 }
"""
DOWN = "actor/layers.0.mlp.down.weight"


def _errors(rank, world):
    import nereus.ir as ir

    rt = Runtime(ir.parse_source(PLAN, "checks.nir"), "A", rank=rank, world_size=world)
    full = {ms: {n: (torch.tensor(3) if n.endswith("#step") else torch.randn(s).to(d))
                 for n, (s, d) in rt.tensor_specs(ms).items()} for ms in ("actor.generation", "actor.training")}
    out = {}

    def attempt(key, call):
        try:
            call()
            out[key] = "accepted"
        except NereusError as error:
            out[key] = str(error).splitlines()[0]

    gen, train = full["actor.generation"], full["actor.training"]
    attempt("transposed", lambda: rt.shard_state_dict("actor.generation", {**gen, DOWN: gen[DOWN].t().contiguous()}))
    attempt("fp32 full", lambda: rt.shard_state_dict("actor.generation", {**gen, DOWN: gen[DOWN].float()}))
    local = rt.shard_state_dict("actor.generation", gen)
    attempt("fp16 local", lambda: rt.register("actor.generation", {**local, DOWN: local[DOWN].half()}))
    attempt("step on generation", lambda: rt.register("actor.generation", {**local, "actor/#step": torch.tensor(2)}))
    trained = rt.shard_state_dict("actor.training", train)
    attempt("fractional step", lambda: rt.register("actor.training", {**trained, "actor/#step": 2.7}))
    attempt("fractional step in full", lambda: rt.shard_state_dict("actor.training", {**train, "actor/#step": 2.5}))
    attempt("good", lambda: rt.register("actor.generation", local))
    attempt("good step", lambda: rt.register("actor.training", {**trained, "actor/#step": 4.0}))
    out["step"] = int(rt.state("actor.training")["actor/#step"])
    return out


def test_what_is_given_is_checked_against_the_model():
    (out,) = spawn_ok(_errors, 1)
    assert out["transposed"] == f"error: {DOWN}: the full tensor is [64, 32] bfloat16, actor needs [32, 64] bfloat16"
    assert out["fp32 full"] == f"error: {DOWN}: the full tensor is [32, 64] float32, actor needs [32, 64] bfloat16"
    assert out["fp16 local"] == f"error: {DOWN}: the local tensor is float16, the layout says bfloat16"
    assert out["step on generation"] == "error: actor/#step: actor.generation holds no optimizer state, so no Adam step"
    assert out["fractional step"] == "error: actor/#step: an Adam step is a whole number ≥ 0, found 2.7"
    assert out["fractional step in full"] == "error: actor/#step: an Adam step is a whole number ≥ 0, found 2.5"
    assert out["good"] == out["good step"] == "accepted" and out["step"] == 4


pytestmark = pytest.mark.multiprocess

"""The distributed forward (llama.py's functions on TP shards, the RL pipeline across PP
stages) equals the single-process reference `nereus.models.logits` for each family, at
TP 2 and 4 (KV heads replicated when tp > kv_heads), PP 2, and GPU orders that are not
the identity. The reference equals transformers (test_reference_numerics.py). 4 gloo
processes, one run for every case."""

import sys
from pathlib import Path

import pytest

import nereus.ir as ir

sys.path.insert(0, str(Path(__file__).parents[1] / "rl"))
from rl_harness import run_world  # noqa: E402

pytestmark = pytest.mark.multiprocess

SIZES = dict(layers=3, hidden=64, heads=4, kv_heads=2, ffn=96, vocab=96, dtype="fp32")
SCALING = ir.RopeScaling("llama3", 8.0, 1.0, 4.0, 64)
MODELS = {
    "llama31": ir.Model("actor", "llama", rope_theta=500000.0, rope_scaling=SCALING, **SIZES),
    "llama32_tied": ir.Model("actor", "llama", tie_embeddings=True, rope_theta=500000.0, rope_scaling=SCALING,
                             **{**SIZES, "kv_heads": 1}),
    "qwen2": ir.Model("actor", "qwen2", qkv_bias=True, norm_eps=1e-6, rope_theta=1e6, **SIZES),
    "qwen3": ir.Model("actor", "qwen3", qk_norm=True, head_dim=32, norm_eps=1e-6, rope_theta=1e6, **SIZES),
}
# (dp, tp, pp, GPU order): mesh position i runs on process order[i]
LAYOUTS = [(1, 4, 1, (3, 1, 0, 2)), (1, 2, 2, (2, 0, 3, 1)), (2, 2, 1, (1, 3, 2, 0))]


def _hf_state(model, seed):
    import torch

    from nereus.models.hf import hf_targets

    gen = torch.Generator().manual_seed(seed)
    return {name: (1.0 if "norm" in name else 0.0) + 0.1 * torch.randn(t.shape, generator=gen)
            for name, t in hf_targets(model).items()}


def _max_errors():
    """On every rank: for each model and layout, the largest |distributed − reference|
    logit this rank computed (0 where it holds no last stage)."""
    import torch
    import torch.distributed as dist

    from nereus.models import logits, tensor_table
    from nereus.models.hf import hf_to_nereus
    from nereus.models.llama import local_logits
    from nereus.models.parallel import gather_vocab
    from nereus.rl import pipeline
    from nereus.rl.shards import shard
    from nereus.rl.topology import Groups

    groups = Groups()
    errors = {}
    for index, (name, model) in enumerate(MODELS.items()):
        hf = _hf_state(model, index)
        ids = torch.randint(0, model.vocab, (2, 24), generator=torch.Generator().manual_seed(index))
        reference = logits(model, hf, ids)
        full = {k.split("/", 1)[1]: v for k, v in hf_to_nereus(model, hf).items()}
        specs = {spec.name: spec for spec in tensor_table(model)}
        for dp, tp, pp, order in LAYOUTS:
            if pp > 1 and model.tie_embeddings:
                continue
            placement = ir.Placement(ir.ModelStage("actor", "inference"), dp, tp, pp, order, ())
            plan = ir.Plan("P", None, (placement,), (placement,))
            module = ir.Module(ir.Cluster("c", 1, 4, ir.GpuSpec(10**10, 1e12, 1e11), 1e9, 1e9, 10**11), (model,),
                               ir.Workload("w", 2, 12, 12, 1, (("inference", ("actor",)),)), (plan,), ())
            role = groups.for_plan(module, plan, dist.get_world_size())["actor.inference"]
            lo, hi = role.pipe.layers
            held = {n: shard(t, specs[n], tp, role.tp.rank) for n, t in full.items()
                    if specs[n].layer is None or lo <= specs[n].layer < hi}
            with torch.no_grad():
                out, _, _ = pipeline.forward(model, held, ids, role.tp, role.pipe,
                                             lambda h: gather_vocab(local_logits(held, h, role.tp), role.tp))
            error = (out - reference).abs().max() if out is not None else torch.zeros(())
            dist.all_reduce(error, op=dist.ReduceOp.MAX)
            errors[f"{name} dp{dp} tp{tp} pp{pp}"] = error.item()
    return errors


def test_distributed_forward_equals_reference():
    errors = run_world(4, _max_errors, timeout=400)
    assert len(errors) == 4 * 3 - 1  # the tied model keeps pp 1
    assert max(errors.values()) < 1e-5, errors


def _qk_norm_gradients():
    """On 2 ranks (TP 2, GPUs in reverse order): the largest difference between each
    rank's gradient of the replicated q/k norm weights and the single-process gradient."""
    import torch
    import torch.distributed as dist

    from nereus.models import tensor_table
    from nereus.models.hf import hf_to_nereus
    from nereus.models.llama import hidden_states, local_logits
    from nereus.models.parallel import TpGroup, vocab_parallel_logprob
    from nereus.rl.shards import shard

    model = MODELS["qwen3"]
    full = {k.split("/", 1)[1]: v for k, v in hf_to_nereus(model, _hf_state(model, 7)).items()}
    specs = {spec.name: spec for spec in tensor_table(model)}
    ids = torch.randint(0, model.vocab, (2, 16), generator=torch.Generator().manual_seed(7))
    norms = [n for n in full if "q_norm" in n or "k_norm" in n]

    def grads(weights, tp):
        for name in norms:
            weights[name].requires_grad_()
        logp = vocab_parallel_logprob(local_logits(weights, hidden_states(model, weights, ids[:, :-1], tp), tp),
                                      ids[:, 1:], model.vocab, tp)
        return torch.autograd.grad(logp.sum(), [weights[n] for n in norms])

    expected = grads({n: t.clone() for n, t in full.items()}, TpGroup())
    rank = 1 - dist.get_rank()  # process 1 is TP rank 0
    group = dist.new_group([0, 1])
    local = {n: shard(t, specs[n], 2, rank) for n, t in full.items()}
    ours = grads(local, TpGroup(2, rank, group))
    error = torch.stack([(a - b).abs().max() for a, b in zip(ours, expected)]).max()
    dist.all_reduce(error, op=dist.ReduceOp.MAX)
    return error.item(), max(g.abs().max().item() for g in expected)


def test_replicated_qk_norm_gradients_are_whole_on_every_tp_rank():
    error, scale = run_world(2, _qk_norm_gradients)
    assert scale > 1e-3 and error < 1e-5 * max(1.0, scale)

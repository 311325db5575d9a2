"""PPO and GRPO math on whole-batch tensors (pure functions, no communication).

Every rank holds the whole step's rollout after assembly, so advantages are computed on
the global batch and are identical on every rank whatever the layout.

- PPO (Schulman et al. 2017; Ouyang et al. 2022 for the per-token KL penalty):
  token rewards r_t = -β·(log π_old − log π_ref) with the sequence score added on the last
  token; GAE (γ, λ) over the critic's values; advantages whitened over the batch;
  clipped surrogate; clipped value loss.
- GRPO (Shao et al. 2024): advantages (score − group mean)/(group std + ε) on every token,
  no critic; KL to the reference in the loss with the k3 estimator
  exp(ref − logp) − (ref − logp) − 1.

Losses are *partial sums*: a replica's rows summed and divided by the global token count,
so summing the replicas' losses (and gradients) gives the global mean for any DP degree.

Responses that end early (text datasets: a response ends at its first end-of-sequence
token) come with a `mask` [B, T], 1 on the response's tokens and 0 after its end: masked
tokens add nothing to a loss or an advantage and the token count is the mask's sum. With
`mask=None` (every token counts: the built-in tasks) the arithmetic is what it was.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .checks import MINIBATCHES


@dataclass(frozen=True)
class RlConfig:
    algo: str = "ppo"  # "ppo" | "grpo"
    lr: float = 3e-3
    critic_lr: float = 3e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    clip: float = 0.2
    value_clip: float = 0.2
    kl_coef: float = 0.02
    gamma: float = 1.0
    lam: float = 0.95
    group: int = 4  # GRPO: responses per prompt
    minibatches: int = MINIBATCHES  # per step, one epoch
    temperature: float = 1.0


def gae(rewards: torch.Tensor, values: torch.Tensor, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) [B, T] by generalised advantage estimation; V after the last
    token is 0 (episode ends)."""
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    steps = rewards.shape[1]
    for t in reversed(range(steps)):
        next_value = values[:, t + 1] if t + 1 < steps else torch.zeros_like(running)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = delta + gamma * lam * running
        advantages[:, t] = running
    return advantages, advantages + values


def whiten(x: torch.Tensor, eps: float = 1e-8, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(x − mean) / std over the batch, or over the tokens `mask` keeps (others 0)."""
    if mask is None:
        return (x - x.mean()) / (x.std() + eps)
    count = mask.sum().clamp(min=2)
    mean = (x * mask).sum() / count
    var = (((x - mean) * mask) ** 2).sum() / (count - 1)
    return (x - mean) / (var.sqrt() + eps) * mask


def ppo_advantages(score: torch.Tensor, logp_old: torch.Tensor, logp_ref: torch.Tensor,
                   values: torch.Tensor, cfg: RlConfig,
                   mask: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(whitened advantages, returns) [B, T] for scores [B] and per-token tensors [B, T].
    With `mask`, the score lands on each response's last token and the episode ends there
    (values after it count 0)."""
    rewards = -cfg.kl_coef * (logp_old - logp_ref)
    if mask is None:
        rewards[:, -1] += score
        advantages, returns = gae(rewards, values, cfg.gamma, cfg.lam)
        return whiten(advantages), returns
    rewards = rewards * mask
    last = (mask.sum(dim=1).long() - 1).clamp(min=0)
    rewards[torch.arange(rewards.shape[0]), last] += score
    advantages, returns = gae(rewards, values * mask, cfg.gamma, cfg.lam)
    return whiten(advantages, mask=mask), returns * mask


def grpo_advantages(score: torch.Tensor, group: int, steps: int, eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantages [B, T]: rows b·group .. (b+1)·group−1 share a prompt."""
    grouped = score.view(-1, group)
    adv = (grouped - grouped.mean(dim=1, keepdim=True)) / (grouped.std(dim=1, keepdim=True) + eps)
    return adv.reshape(-1, 1).expand(-1, steps).contiguous()


def masked_sum(x: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    return x.sum() if mask is None else (x * mask).sum()


def policy_loss(logp: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor,
                clip: float, total_tokens: int, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Clipped surrogate, summed over these rows, divided by the global token count."""
    ratio = (logp - logp_old).exp()
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(1 - clip, 1 + clip) * advantages)
    return -masked_sum(surrogate, mask) / total_tokens


def kl_k3(logp: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(π‖π_ref): unbiased and ≥ 0 (Schulman 2020)."""
    diff = logp_ref - logp
    return diff.exp() - diff - 1


def value_loss(v: torch.Tensor, v_old: torch.Tensor, returns: torch.Tensor,
               clip: float, total_tokens: int, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Clipped value loss 0.5·max((v−R)², (v_clip−R)²), partial sum / global tokens."""
    clipped = v_old + (v - v_old).clamp(-clip, clip)
    return 0.5 * masked_sum(torch.maximum((v - returns) ** 2, (clipped - returns) ** 2), mask) / total_tokens

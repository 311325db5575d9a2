"""Rule-based tasks whose reward a small random-init model learns in a few hundred steps.

Vocabulary: tokens 0..9 are digits, 10 is BOS; the rest are unused (they make the vocab
divisible by tp). A prompt is BOS then `prompt-1` random digits.

- "sort": the response should be the prompt's digits sorted ascending; the score is the
  fraction of positions that match (dense partial credit).
- "pattern": every response token should be its predecessor + 1 mod 10 (the first one's
  predecessor is the prompt's last digit); score = fraction of tokens that are. A bigram
  rule with per-token credit, so it learns fast (CI).
- "seven": every response token should be 7 (a smoke test of the mechanics).

The llama reward model (`reward.inference`) scores each sequence too; its score is logged
(`rm_score`) but the training signal is the rule, so that learning is checkable.
"""

from __future__ import annotations

import torch

BOS = 10
TASKS = ("pattern", "sort", "seven")


def make_prompts(batch: int, prompt_len: int, generator: torch.Generator, group: int = 1) -> torch.Tensor:
    """[batch, prompt_len] prompts; with group > 1 each prompt is repeated `group` times
    consecutively (GRPO)."""
    digits = torch.randint(0, 10, (batch // group, prompt_len - 1), generator=generator)
    digits = digits.repeat_interleave(group, dim=0)
    return torch.cat([torch.full((batch, 1), BOS, dtype=torch.long), digits], dim=1)


def target(task: str, prompts: torch.Tensor, response_len: int) -> torch.Tensor:
    """The ideal response [B, response_len] of each prompt."""
    digits = prompts[:, 1:]
    if task == "sort":
        wanted = digits.sort(dim=1).values
        reps = -(-response_len // wanted.shape[1])
        return wanted.repeat(1, reps)[:, :response_len]
    if task == "seven":
        return torch.full((prompts.shape[0], response_len), 7)
    if task == "pattern":
        steps = torch.arange(1, response_len + 1)
        return (digits[:, -1:] + steps) % 10
    raise ValueError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")


def score(task: str, prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
    """Rule score in [0, 1] per sequence: fraction of response positions that match."""
    if task == "pattern":
        previous = torch.cat([prompts[:, -1:], responses[:, :-1]], dim=1)
        return (responses == (previous + 1) % 10).float().mean(dim=1)
    wanted = target(task, prompts, responses.shape[1])
    return (responses == wanted).float().mean(dim=1)

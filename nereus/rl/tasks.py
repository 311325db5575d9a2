"""Where a step's prompts and rewards come from: a built-in task on token ids, or a text
dataset with a tokenizer and the user's reward function.

Both give the trainer the same four things per step:
  batch(position, gen)      the step's prompts (ids [B, P], pad counts or None, rows)
  finish(responses)         the responses with every token after the end-of-sequence
                            token set to pad, and the mask of the tokens that count
                            (None: all count)
  rewards(batch, responses) [B] float rewards, the same on every rank
  texts(batch, responses)   prompt and response text per sample (samples.jsonl)
and `consumed(B)`: how many dataset rows a step of batch B uses (the data position moves by
it; 0 for the built-in tasks, whose prompts are drawn from the step's generator).

BuiltinTask is the rule-based tasks of nereus.rl.reward (`--task pattern|sort|seven`),
computed on every rank as before. TextTask (nereus.rl.data, nereus.rl.reward_fn) decodes
on rank 0, calls the reward function there and broadcasts the rewards (or the function's
error, which every rank then raises alike, so the job ends with it).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from nereus.ir.diagnostics import NereusError

from .data import Batch, PromptData, Specials, load_tokenizer
from .reward import make_prompts, score
from .reward_fn import call_reward, load_reward


class BuiltinTask:
    """The token-id tasks of nereus.rl.reward."""

    def __init__(self, name: str, group: int):
        self.name, self.group = name, group

    def consumed(self, batch: int) -> int:
        return 0

    def batch(self, batch: int, prompt: int, position: int, gen: torch.Generator) -> Batch:
        return Batch(make_prompts(batch, prompt, gen, self.group))

    def finish(self, responses: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        return responses, None

    def rewards(self, batch: Batch, responses: torch.Tensor, step: int) -> torch.Tensor:
        return score(self.name, batch.ids, responses)

    def texts(self, batch: Batch, responses: torch.Tensor) -> tuple[list, list]:
        def digits(row) -> str:
            return " ".join(str(t) for t in row)
        return [digits(r) for r in batch.ids.tolist()], [digits(r) for r in responses.tolist()]


class TextTask:
    """A prompt dataset, its tokenizer and the user's reward function (module docstring)."""

    def __init__(self, prompts: str, tokenizer: str, reward: str, seed: int, max_tokens: int, group: int,
                 vocab: int):
        self.tokenizer = load_tokenizer(tokenizer)
        check_vocab(self.tokenizer, tokenizer, vocab)
        self.specials = Specials.of(self.tokenizer)
        self.data = PromptData.load(prompts, self.tokenizer, seed, max_tokens)
        self.group, self.spec = group, reward
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.function = load_reward(reward) if self.rank == 0 else None
        self._decoded: Optional[tuple] = None  # (responses tensor, its texts) of the step, rank 0

    def consumed(self, batch: int) -> int:
        return batch // self.group

    def batch(self, batch: int, prompt: int, position: int, gen: torch.Generator) -> Batch:
        if prompt != self.data.max_tokens:
            raise NereusError(f"the workload's prompt is {prompt} tokens, the dataset was padded to "
                              f"{self.data.max_tokens}", hint="--drift cannot change the prompt length of a dataset")
        return self.data.batch(position, batch // self.group, self.group)

    def finish(self, responses: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Tokens after each response's first eos become pad; the mask keeps the eos."""
        if self.specials.eos is None:
            return responses, None
        ended = (responses == self.specials.eos).long().cumsum(dim=1)
        after = (ended - (responses == self.specials.eos).long()) > 0  # strictly after the first eos
        mask = (~after).float()
        return responses.masked_fill(after, self.specials.pad), mask

    def _response_texts(self, responses: torch.Tensor) -> list[str]:
        if self._decoded is None or self._decoded[0] is not responses:
            texts = []
            for row in responses.tolist():
                if self.specials.eos is not None and self.specials.eos in row:
                    row = row[:row.index(self.specials.eos)]
                texts.append(self.tokenizer.decode(row, skip_special_tokens=True))
            self._decoded = (responses, texts)
        return self._decoded[1]

    def rewards(self, batch: Batch, responses: torch.Tensor, step: int) -> torch.Tensor:
        box: list = [None]
        if self.rank == 0:
            prompts = [row.prompt for row in batch.rows]
            fields = {key: [row.fields.get(key) for row in batch.rows] for key in batch.rows[0].fields}
            try:
                box[0] = ("ok", call_reward(self.function, self.spec, prompts, self._response_texts(responses),
                                            fields, step))
            except NereusError as error:
                box[0] = ("error", error.message, error.hint)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(box, src=0)
        if box[0][0] == "error":
            raise NereusError(box[0][1], hint=box[0][2])
        return torch.tensor(box[0][1], dtype=torch.float32)

    def texts(self, batch: Batch, responses: torch.Tensor) -> tuple[list, list]:
        return [row.prompt for row in batch.rows], self._response_texts(responses)


def check_vocab(tokenizer, directory: str, vocab: int) -> None:
    """The tokenizer's ids fit the actor's vocabulary."""
    size = len(tokenizer)
    if size > vocab:
        raise NereusError(f"--tokenizer {directory} has {size} tokens, the actor's vocab is {vocab}",
                          hint="use the actor's own tokenizer (its hf() folder) or a model with a larger vocab")

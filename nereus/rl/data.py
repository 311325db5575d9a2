"""Prompts from a dataset, tokenized for the RL loop (`nereus train --prompts FILE`).

Input: a JSONL file (one JSON object per line with a `prompt` field: a string, or a list
of chat messages {"role", "content"}) or a Hugging Face `datasets` folder written by
`save_to_disk` (rows with a `prompt` column), a local Hugging Face tokenizer directory,
the longest prompt in tokens and the run's seed. Output: `PromptData`, whose `take(position,
count)` gives the next `count` rows of a seeded shuffle (reshuffled each epoch), each
tokenized (through the tokenizer's chat template when it has one) and the batch's ids
left-padded to `max_tokens` with the count of pad tokens per row.
Invariant: every rank that loads the same file with the same tokenizer and seed gets the
same rows in the same order, so a step's batch is a function of (seed, position) alone:
a resumed run continues the order from the saved position.

Rows whose prompt is longer than `max_tokens` are left out (counted in `skipped`): a
truncated prompt would lose the question or the chat template's generation prompt.
The other fields of a row (e.g. a reference `answer`) travel with it to the reward
function (nereus.rl.reward_fn).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from nereus.ir.diagnostics import NereusError
from nereus.ir.model import Location

PROMPT_FIELD = "prompt"


@dataclass(frozen=True)
class PromptRow:
    """One dataset row: its prompt as the dataset gives it, the token ids the model reads
    and the row's other fields."""

    prompt: Any
    ids: tuple[int, ...]
    fields: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Batch:
    """A step's prompts: ids [B, max_tokens] left-padded, `pad` [B] pad tokens per row
    (None for the built-in tasks, whose prompts are never padded), the rows (None for the
    built-in tasks) repeated per GRPO group as the ids are."""

    ids: torch.Tensor
    pad: Optional[torch.Tensor] = None
    rows: Optional[list] = None


def read_rows(path: str) -> list[dict]:
    """The rows of a JSONL file or a `save_to_disk` folder, as dicts. Errors name the
    file and line (JSONL) and say what is missing."""
    if os.path.isdir(path):
        return _dataset_rows(path)
    if not os.path.isfile(path):
        raise NereusError(f"--prompts {path}: no such file or folder",
                          hint="a JSONL file with a 'prompt' field per line, or a datasets folder (save_to_disk)")
    rows = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise NereusError(f"not JSON: {error.msg}", Location(path, number, error.colno),
                                  hint="one JSON object per line, e.g. {\"prompt\": \"2+3=\", \"answer\": \"5\"}",
                                  source=_source(path)) from None
            _check_row(row, Location(path, number, 1), path)
            rows.append(row)
    if not rows:
        raise NereusError(f"--prompts {path}: no rows", hint="one JSON object per line with a 'prompt' field")
    return rows


def _source(path: str) -> Optional[str]:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except (OSError, UnicodeDecodeError):
        return None


def _check_row(row, loc: Location, path: str) -> None:
    if not isinstance(row, dict) or PROMPT_FIELD not in row:
        raise NereusError(f"a row without a '{PROMPT_FIELD}' field", loc, source=_source(path),
                          hint="each row is a JSON object with a 'prompt' (text, or a list of chat messages)")
    prompt = row[PROMPT_FIELD]
    chat = isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt)
    if not isinstance(prompt, str) and not (chat and prompt):
        raise NereusError(f"'{PROMPT_FIELD}' is {type(prompt).__name__}, not text or a list of chat messages", loc,
                          source=_source(path), hint='e.g. "2+3=" or [{"role": "user", "content": "2+3="}]')


def _dataset_rows(path: str) -> list[dict]:
    try:
        import datasets
    except ImportError:
        raise NereusError(f"--prompts {path} is a folder: reading a Hugging Face dataset needs `datasets`",
                          hint="pip install 'nereus[rl]' (or datasets), or give a JSONL file") from None
    try:
        data = datasets.load_from_disk(path)
    except FileNotFoundError as error:
        raise NereusError(f"--prompts {path}: not a dataset saved with save_to_disk ({error})",
                          hint="save one with Dataset.save_to_disk(path), or give a JSONL file") from None
    if isinstance(data, datasets.DatasetDict):
        if "train" not in data and len(data) != 1:
            raise NereusError(f"--prompts {path}: a DatasetDict with splits {sorted(data)} and no 'train'",
                              hint="save the split to train on (dataset['train'].save_to_disk(path))")
        data = data["train"] if "train" in data else next(iter(data.values()))
    if PROMPT_FIELD not in data.column_names:
        raise NereusError(f"--prompts {path}: no '{PROMPT_FIELD}' column (columns: {', '.join(data.column_names)})",
                          hint="rename the column with the prompts to 'prompt' (dataset.rename_column)")
    rows = data.to_list()
    for index, row in enumerate(rows):
        _check_row(row, Location(f"{path}[row {index}]", 1, 1), path)
    if not rows:
        raise NereusError(f"--prompts {path}: no rows")
    return rows


def load_tokenizer(directory: str):
    """A local Hugging Face tokenizer (transformers' AutoTokenizer, no download)."""
    try:
        import transformers
    except ImportError:
        raise NereusError("--prompts needs transformers for the tokenizer",
                          hint="pip install 'nereus[rl]' (or transformers)") from None
    if not os.path.isdir(directory):
        raise NereusError(f"--tokenizer {directory}: no such folder",
                          hint="a folder with tokenizer.json / tokenizer_config.json (save_pretrained)")
    try:
        return transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as error:
        raise NereusError(f"--tokenizer {directory}: transformers cannot load a tokenizer from it ({error})",
                          hint="save one with tokenizer.save_pretrained(folder)") from None


def encode(tokenizer, prompt) -> list[int]:
    """Token ids of one prompt: through the chat template when the tokenizer has one (a
    text prompt becomes one user message, with the generation prompt appended), else the
    tokenizer's own encoding (its special tokens, e.g. BOS, included)."""
    if getattr(tokenizer, "chat_template", None):
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if isinstance(prompt, list):
        raise NereusError("a prompt is a list of chat messages but the tokenizer has no chat template",
                          hint="give text prompts, or a tokenizer with a chat_template")
    return list(tokenizer(prompt)["input_ids"])


@dataclass(frozen=True)
class Specials:
    """The token ids the loop needs from the tokenizer: pad (left padding, and after a
    response's end), eos (a response ends at its first one; None: responses run to full
    length)."""

    pad: int
    eos: Optional[int]

    @staticmethod
    def of(tokenizer) -> "Specials":
        eos = tokenizer.eos_token_id
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
        return Specials(int(pad) if pad is not None else 0, int(eos) if eos is not None else None)


class PromptData:
    """The dataset's rows in the run's seeded order (see the module docstring)."""

    def __init__(self, rows: list[PromptRow], seed: int, max_tokens: int, pad_id: int, skipped: int = 0):
        if not rows:
            raise NereusError(f"no prompt fits --max-prompt-tokens {max_tokens} ({skipped} longer)",
                              hint="raise --max-prompt-tokens (the workload's prompt length is set to it)")
        self.rows, self.seed, self.max_tokens, self.pad_id, self.skipped = rows, seed, max_tokens, pad_id, skipped
        self._order: dict[int, list[int]] = {}

    @staticmethod
    def load(path: str, tokenizer, seed: int, max_tokens: int) -> "PromptData":
        raw = read_rows(path)
        rows, skipped = [], 0
        for row in raw:
            ids = encode(tokenizer, row[PROMPT_FIELD])
            if len(ids) > max_tokens or not ids:
                skipped += 1
                continue
            rows.append(PromptRow(row[PROMPT_FIELD], tuple(ids), {k: v for k, v in row.items() if k != PROMPT_FIELD}))
        return PromptData(rows, seed, max_tokens, Specials.of(tokenizer).pad, skipped)

    def order(self, epoch: int) -> list[int]:
        """The row indices of `epoch` (0-based): a permutation seeded by (seed, epoch)."""
        if epoch not in self._order:
            gen = torch.Generator().manual_seed(self.seed * 1_000_033 + 7_919 * epoch + 1)
            self._order = {epoch: torch.randperm(len(self.rows), generator=gen).tolist()}
        return self._order[epoch]

    def take(self, position: int, count: int) -> list[PromptRow]:
        """`count` rows from `position` (rows consumed before) on, across epochs."""
        out = []
        for at in range(position, position + count):
            epoch, index = divmod(at, len(self.rows))
            out.append(self.rows[self.order(epoch)[index]])
        return out

    def batch(self, position: int, count: int, group: int) -> Batch:
        """A step's batch of `count` distinct rows from `position`, each repeated `group`
        times consecutively (GRPO; 1 for PPO)."""
        rows = [row for row in self.take(position, count) for _ in range(group)]
        ids = torch.full((len(rows), self.max_tokens), self.pad_id, dtype=torch.long)
        pad = torch.empty(len(rows), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, self.max_tokens - len(row.ids):] = torch.tensor(row.ids, dtype=torch.long)
            pad[i] = self.max_tokens - len(row.ids)
        return Batch(ids, pad, rows)

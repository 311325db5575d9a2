"""Text prompts for the RL loop, without processes: reading JSONL and `datasets` folders
(errors at the line), the tokenizer's chat template, the seeded order and its epochs,
left padding, eos masking, the reward function's checks, and the masked losses."""

import json
import os

import pytest
import torch

from nereus.ir.diagnostics import NereusError
from nereus.rl import algorithms as alg
from nereus.rl.data import PromptData, Specials, encode, load_tokenizer, read_rows
from nereus.rl.reward_fn import call_reward, load_reward
from nereus.rl.tasks import TextTask

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARITH = os.path.join(ROOT, "examples", "rl", "arith")
TOKENIZER = os.path.join(ARITH, "tiny-arith")


@pytest.fixture(scope="module")
def tokenizer():
    pytest.importorskip("transformers")
    return load_tokenizer(TOKENIZER)


def test_jsonl_errors_name_the_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", \n')
    with pytest.raises(NereusError) as caught:
        read_rows(str(bad))
    assert caught.value.loc.line == 2 and "not JSON" in caught.value.message
    bad.write_text('{"prompt": "1+1="}\n{"question": "2+2="}\n')
    with pytest.raises(NereusError, match="without a 'prompt' field") as caught:
        read_rows(str(bad))
    assert caught.value.loc.line == 2
    bad.write_text('{"prompt": 3}\n')
    with pytest.raises(NereusError, match="'prompt' is int"):
        read_rows(str(bad))


def test_a_datasets_folder_reads_like_the_jsonl(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = read_rows(os.path.join(ARITH, "train.jsonl"))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    assert read_rows(str(tmp_path / "ds")) == rows
    datasets.Dataset.from_list([{"question": "1"}]).save_to_disk(str(tmp_path / "no-prompt"))
    with pytest.raises(NereusError, match="no 'prompt' column"):
        read_rows(str(tmp_path / "no-prompt"))


def test_chat_template_order_epochs_and_padding(tokenizer):
    # the template puts "Q" before the user's text (examples/rl/arith/make_arith.py)
    assert tokenizer.decode(encode(tokenizer, "3+4=")) == "Q3+4="
    data = PromptData.load(os.path.join(ARITH, "train.jsonl"), tokenizer, seed=5, max_tokens=6)
    assert data.skipped == 64 and len(data.rows) == 25  # "Qa+b+c=" is 7 tokens: left out
    again = PromptData.load(os.path.join(ARITH, "train.jsonl"), tokenizer, seed=5, max_tokens=8)
    first = [r.prompt for r in again.take(0, len(again.rows))]
    assert sorted(first) == sorted(r.prompt for r in again.rows)  # an epoch is a permutation
    assert first != [r.prompt for r in again.take(len(again.rows), len(again.rows))]  # reshuffled each epoch
    assert [r.prompt for r in again.take(10, 5)] == first[10:15]  # a position continues the order
    other = PromptData.load(os.path.join(ARITH, "train.jsonl"), tokenizer, seed=6, max_tokens=8)
    assert [r.prompt for r in other.take(0, 20)] != first[:20]
    batch = again.batch(0, 3, group=2)
    assert batch.ids.shape == (6, 8) and torch.equal(batch.ids[0], batch.ids[1])
    for row, ids, pad in zip(batch.rows, batch.ids, batch.pad):
        assert ids[:pad].eq(Specials.of(tokenizer).pad).all() and tuple(ids[pad:].tolist()) == row.ids


def test_finish_masks_after_the_first_eos(tokenizer, monkeypatch):
    task = TextTask.__new__(TextTask)
    task.specials = Specials(pad=0, eos=2)
    responses = torch.tensor([[5, 2, 6, 2], [5, 6, 7, 8], [2, 9, 9, 9]])
    tokens, mask = task.finish(responses)
    assert tokens.tolist() == [[5, 2, 0, 0], [5, 6, 7, 8], [2, 0, 0, 0]]
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]


def test_reward_function_errors_name_the_row(tmp_path):
    path = tmp_path / "r.py"
    path.write_text("def reward(prompts, responses, answer, **row):\n"
                    "    return [1.0 / (int(a) - 7) for a in answer]\n"
                    "def short(prompts, responses, **row):\n    return [0.0]\n"
                    "def nan(prompts, responses, **row):\n    return [float('nan')] * len(prompts)\n")
    fn = load_reward(f"{path}:reward")
    prompts, responses, fields = ["1+1=", "3+4="], ["2", "7"], {"answer": ["2", "7"]}
    with pytest.raises(NereusError, match=r"ZeroDivisionError.*step 3, sample 1: prompt '3\+4=', response '7'"):
        call_reward(fn, "r.py:reward", prompts, responses, fields, 3)
    with pytest.raises(NereusError, match="returned 1 rewards for 2 samples"):
        call_reward(load_reward(f"{path}:short"), "s", prompts, responses, fields, 1)
    with pytest.raises(NereusError, match="returned nan on step 1, sample 0"):
        call_reward(load_reward(f"{path}:nan"), "n", prompts, responses, fields, 1)
    with pytest.raises(NereusError, match="has no function 'missing'"):
        load_reward(f"{path}:missing")
    with pytest.raises(NereusError, match="write MODULE:FUNCTION"):
        load_reward("nocolon")
    assert call_reward(load_reward(os.path.join(ARITH, "reward.py") + ":reward"), "a", ["3+4="] * 4,
                       ["7", "5", "x", "12"], {"answer": ["7", "7", "7", "7"]}, 1) == [1.0, 0.2 + 0.3 * 7 / 9, 0.0, 0.1]


def test_masked_losses_equal_the_unmasked_ones_on_full_masks():
    gen = torch.Generator().manual_seed(0)
    logp, old, ref, adv = (torch.randn(4, 5, generator=gen) for _ in range(4))
    ones = torch.ones(4, 5)
    assert torch.equal(alg.policy_loss(logp, old, adv, 0.2, 20), alg.policy_loss(logp, old, adv, 0.2, 20, ones))
    half = ones.clone()
    half[:, 3:] = 0
    cut = alg.policy_loss(logp[:, :3], old[:, :3], adv[:, :3], 0.2, 12)
    assert torch.allclose(alg.policy_loss(logp, old, adv, 0.2, 12, half), cut)
    from nereus.rl.algorithms import RlConfig

    score, values = torch.rand(4, generator=gen), torch.randn(4, 5, generator=gen)
    full_adv, full_ret = alg.ppo_advantages(score, old, ref, values, RlConfig(), None)
    # the masked form on a full mask: the same advantages and returns up to the whitening's rounding
    masked_adv, masked_ret = alg.ppo_advantages(score, old, ref, values, RlConfig(), ones)
    assert torch.allclose(full_adv, masked_adv, atol=1e-5) and torch.allclose(full_ret, masked_ret)
    # an early end: the score lands on the last kept token and nothing after it counts
    masked_adv, masked_ret = alg.ppo_advantages(score, old, ref, values, RlConfig(), half)
    assert masked_adv[:, 3:].eq(0).all() and masked_ret[:, 3:].eq(0).all()
    cut_adv, _ = alg.ppo_advantages(score, old[:, :3].clone(), ref[:, :3], values[:, :3], RlConfig(), None)
    assert torch.allclose(masked_adv[:, :3], cut_adv, atol=1e-5)

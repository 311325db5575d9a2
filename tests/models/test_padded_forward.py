"""Left-padded prompts (text datasets: rows of different lengths in one batch): with each
row's pad count, the llama forward masks the pads out of attention and counts positions
from the row's first real token, as transformers does with an attention mask. Checked
against transformers' logits of the padded batch with its mask and of each row alone, for
a prefill and for KV-cache decoding (the rollout's path)."""

import pytest
import torch

import nereus.ir as ir
from nereus.models import family
from nereus.models.hf import hf_to_nereus
from nereus.models.llama import KvCache, local_logits
from nereus.models.parallel import TpGroup

from hf_tiny import nir, write_checkpoint


def _setup(tmp_path, name):
    hf_model = write_checkpoint(name, tmp_path / "ckpt")
    (tmp_path / "plan.nir").write_text(nir("ckpt"))
    model = ir.parse_file(tmp_path / "plan.nir").model("actor")
    weights = {k.split("/", 1)[1]: v.float() for k, v in hf_to_nereus(model, hf_model.state_dict()).items()}
    return hf_model, model, weights


def _batch(vocab):
    gen = torch.Generator().manual_seed(3)
    lengths = [7, 4, 1]
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(1, vocab, (n,), generator=gen)
    pad = torch.tensor([width - n for n in lengths])
    return ids, pad, lengths


@pytest.mark.parametrize("name", ["llama31", "qwen3"])
def test_padded_rows_equal_transformers_and_each_row_alone(tmp_path, name):
    hf_model, model, weights = _setup(tmp_path, name)
    forward, tp = family(model), TpGroup()
    ids, pad, lengths = _batch(model.vocab)
    mask = (torch.arange(ids.shape[1]).unsqueeze(0) >= pad.unsqueeze(1)).long()
    with torch.no_grad():
        expected = hf_model(ids, attention_mask=mask).logits
        ours = local_logits(weights, forward.hidden_states(model, weights, ids, tp, pad=pad), tp)
        unpadded = local_logits(weights, forward.hidden_states(model, weights, ids, tp), tp)
    real = mask.bool()
    assert (ours[real] - expected[real]).abs().max().item() < 1e-4
    assert not torch.isnan(ours).any()
    for row, n in enumerate(lengths):  # each row alone, no pads
        with torch.no_grad():
            alone = hf_model(ids[row:row + 1, ids.shape[1] - n:]).logits[0]
        assert (ours[row, ids.shape[1] - n:] - alone).abs().max().item() < 1e-4
    # without the pad counts the padded rows attend to their pads: the check above can fail
    assert (unpadded[1, -1] - ours[1, -1]).abs().max().item() > 1e-3


def test_kv_cache_decoding_of_padded_rows_equals_the_full_forward(tmp_path):
    _, model, weights = _setup(tmp_path, "llama31")
    forward, tp = family(model), TpGroup()
    ids, pad, _ = _batch(model.vocab)
    more = torch.randint(1, model.vocab, (ids.shape[0], 3), generator=torch.Generator().manual_seed(4))
    whole = torch.cat([ids, more], dim=1)
    with torch.no_grad():
        full = local_logits(weights, forward.hidden_states(model, weights, whole, tp, pad=pad), tp)
        cache = KvCache.empty(model.layers)
        steps = [local_logits(weights, forward.hidden_states(model, weights, ids, tp, cache, pad=pad), tp)[:, -1]]
        for i in range(more.shape[1]):
            steps.append(local_logits(weights, forward.hidden_states(model, weights, more[:, i:i + 1], tp, cache,
                                                                     pad=pad), tp)[:, -1])
    for i, logits in enumerate(steps):
        assert (logits - full[:, ids.shape[1] - 1 + i]).abs().max().item() < 1e-5

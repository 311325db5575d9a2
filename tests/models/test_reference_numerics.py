"""nereus.models.logits equals transformers' logits (fp32, CPU) for a tiny random model of
each family, read through `model actor = hf("...")` from the checkpoint transformers wrote."""

import re

import pytest
import torch

import nereus.ir as ir
from nereus.models import logits, parameter_count

from hf_tiny import TINY, nir, write_checkpoint


@pytest.mark.parametrize("name", sorted(TINY))
def test_reference_logits_equal_transformers(tmp_path, name):
    hf_model = write_checkpoint(name, tmp_path / "ckpt")
    (tmp_path / "plan.nir").write_text(nir("ckpt"))
    model = ir.parse_file(tmp_path / "plan.nir").model("actor")
    assert parameter_count(model) == hf_model.num_parameters()
    ids = torch.randint(0, model.vocab, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf_model(ids).logits
    ours = logits(model, hf_model.state_dict(), ids)
    assert ours.dtype == torch.float32 and ours.shape == expected.shape
    assert (ours - expected).abs().max().item() < 1e-4


def test_each_trait_changes_the_logits(tmp_path):
    """The comparison above is sensitive: dropping rope scaling, eps or q/k norm breaks it."""
    hf_model = write_checkpoint("llama31", tmp_path / "ckpt")
    (tmp_path / "plan.nir").write_text(nir("ckpt"))
    model = ir.parse_file(tmp_path / "plan.nir").model("actor")
    ids = torch.randint(0, model.vocab, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf_model(ids).logits
    from dataclasses import replace

    for changed in (replace(model, rope_scaling=None), replace(model, norm_eps=1e-6), replace(model, rope_theta=1e4)):
        assert (logits(changed, hf_model.state_dict(), ids) - expected).abs().max().item() > 1e-4


@pytest.mark.parametrize("ids, message", [
    (torch.tensor([1, 2, 3]), "input_ids must be a [batch, tokens] tensor of token ids, got shape [3]"),
    (torch.tensor([[1.0, 2.0]]), "input_ids must be a [batch, tokens] tensor of token ids, got torch.float32"),
    (torch.tensor([[1, 96]]), "input_ids holds 96, outside the vocabulary [0, 96) of actor"),
    (torch.tensor([[-1, 2]]), "input_ids holds -1, outside the vocabulary [0, 96) of actor"),
])
def test_bad_input_ids_are_errors_that_say_so(tmp_path, ids, message):
    model_hf = write_checkpoint("llama31", tmp_path / "ckpt")
    (tmp_path / "plan.nir").write_text(nir("ckpt"))
    model = ir.parse_file(tmp_path / "plan.nir").model("actor")
    with pytest.raises(ir.NereusError, match=re.escape(message)):
        logits(model, model_hf.state_dict(), ids)

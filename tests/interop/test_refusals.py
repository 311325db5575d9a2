"""What reshard_module refuses: each an InteropError on every rank, naming the tensor, with
nothing moved and the source untouched; and a failure inside the transition is
TransitionAborted on every rank with the source untouched (2 gloo ranks, a tiny module)."""

import pytest


def _module(layout: str, meta: bool = False, rows: int = 6):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard, DTensor, distribute_tensor

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, rows, bias=False), torch.nn.Linear(rows, 3, bias=False))
    if meta:
        model = model.to("meta")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    for module in model:
        weight = module.weight
        if layout == "partial":
            local = weight.detach() / 2
            dt = DTensor.from_local(local, mesh, [Partial()], run_check=False)
        else:
            dt = distribute_tensor(weight.detach(), mesh, [Shard(0) if layout == "shard" else Replicate()],
                                   src_data_rank=None)
        module.weight = torch.nn.Parameter(dt)
    return model


def _trained(layout: str):
    import torch

    model = _module(layout)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    if layout != "partial":  # Adam state from one step on sum(w^2)
        loss = sum((p * p).sum() for p in model.parameters())
        (loss.full_tensor() if hasattr(loss, "full_tensor") else loss).backward()
        optim.step()
    return model, optim


def _snapshot(model, optim):
    import torch

    out = {n: p.to_local().clone() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        for k, v in optim.state.get(p, {}).items():
            out[f"{n}:{k}"] = (v.to_local() if hasattr(v, "to_local") else v).clone()
    return out


def _same(a, b) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _cases(rank, world):
    import os

    import torch

    from nereus.interop import InteropError, reshard_module
    from nereus.runtime import TransitionAborted

    out = {}

    def attempt(key, src, src_optim, dst, dst_optim):
        before = _snapshot(src, src_optim) if src_optim is not None else None
        try:
            reshard_module(src, src_optim, dst, dst_optim)
            out[key] = ("no error", None)
        except (InteropError, TransitionAborted) as error:
            untouched = before is None or _same(before, _snapshot(src, src_optim))
            out[key] = (type(error).__name__, error.message if hasattr(error, "message") else str(error), untouched)

    src, src_optim = _trained("shard")
    attempt("partial", *_trained("partial"), _module("shard", meta=True), torch.optim.AdamW(
        _module("shard", meta=True).parameters()))
    dst = _module("replicate", meta=True, rows=5)
    attempt("shape", src, src_optim, dst, torch.optim.AdamW(dst.parameters()))
    dst = _module("replicate", meta=True)
    attempt("one_optimizer", src, src_optim, dst, None)
    dst = _module("replicate", meta=True)
    attempt("groups", src, src_optim, dst, torch.optim.AdamW([{"params": [dst[0].weight]}, {"params": [dst[1].weight]}]))
    dst = _module("replicate", meta=True)
    os.environ["NEREUS_FAULT"] = "1:0:pack"
    attempt("fault", src, src_optim, dst, torch.optim.AdamW(dst.parameters()))
    del os.environ["NEREUS_FAULT"]
    dst = _module("replicate", meta=True)
    dst_optim = torch.optim.AdamW(dst.parameters())
    report = reshard_module(src, src_optim, dst, dst_optim)  # after all that, a good call works
    out["after"] = (report.bytes_sent, report.lower_bound_bytes)
    return out


@pytest.fixture(scope="module")
def results():
    from runtime_helpers import spawn_ok

    return spawn_ok(_cases, 2)


EXPECTED = {
    "partial": ("InteropError", "0.weight has a P(sum) placement, which Nereus cannot move"),
    "shape": ("InteropError", "0.weight is [6, 4] fp32 in the source but [5, 4] fp32 in the destination"),
    "one_optimizer": ("InteropError", "give both optimizers or neither"),
    "groups": ("InteropError", "the source optimizer has 1 parameter groups, the destination 2"),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_refused_on_every_rank_with_the_source_untouched(results, case):
    for rank, found in enumerate(results):
        kind, message, untouched = found[case]
        assert (kind, message.split("rank 0: ")[-1]) == EXPECTED[case], (rank, found[case])
        assert untouched


@pytest.mark.multiprocess
def test_a_failed_transition_aborts_every_rank_and_keeps_the_source(results):
    for found in results:
        kind, message, untouched = found["fault"]
        assert kind == "TransitionAborted" and untouched, found["fault"]
        assert found["after"][0] == found["after"][1]

"""A transformers Llama in the five layouts of issue 40, on 4 gloo ranks: replicated,
FSDP 4, TP 4, FSDP 2 x TP 2 (mesh (dp, tp)) and TP 2 x FSDP 2 (mesh (tp, dp)). Sizes
are chosen so that some splits are uneven (torch.chunk: the vocabulary of 66 rows over 4
ranks is 17, 17, 17, 15; embeddings over dp 2 are 33 and 33)."""

from __future__ import annotations

import torch

LAYOUTS = ("replicated", "fsdp4", "tp4", "fsdp2_tp2", "tp2_fsdp2")
TP_PLAN = {"self_attn.q_proj": "col", "self_attn.k_proj": "col", "self_attn.v_proj": "col", "self_attn.o_proj": "row",
           "mlp.gate_proj": "col", "mlp.up_proj": "col", "mlp.down_proj": "row"}


SIZES = dict(vocab_size=66, hidden_size=32, intermediate_size=52, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, max_position_embeddings=64, rope_theta=10000.0)


def config(family: str = "llama"):
    """A tiny config of `family`: llama, qwen2 (q/k/v biases), qwen3 (q/k norms) or
    qwen3_moe (transformers 5's stacked experts, [experts, 2 x ffn, hidden])."""
    import transformers

    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**SIZES, moe_intermediate_size=12, num_experts=4, num_experts_per_tok=2)
    name = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}[family]
    return getattr(transformers, name)(**SIZES)


def _model_class(family: str):
    import transformers

    return getattr(transformers, {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                  "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}[family])


def build(layout: str, meta: bool = False, seed: int = 0, family: str = "llama"):
    """The model in `layout` (weights from `seed`, or on the meta device). A MoE model's
    tensor parallelism splits its attention only (its experts are stacked tensors)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(seed)
    cls = _model_class(family)
    if meta:
        with torch.device("meta"):
            model = cls(config(family))
    else:
        model = cls(config(family))
    plan = {k: ColwiseParallel() if v == "col" else RowwiseParallel() for k, v in TP_PLAN.items()
            if family != "qwen3_moe" or k.startswith("self_attn")}
    if layout == "replicated":
        return model
    if layout == "fsdp4":
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout == "tp4":
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
        for layer in model.model.layers:
            parallelize_module(layer, mesh, plan)
    elif layout == "hsdp2x2":  # FSDP2's hybrid sharding: replicated over 2, sharded over 2
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        names = ("dp", "tp") if layout == "fsdp2_tp2" else ("tp", "dp")
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
        for layer in model.model.layers:
            parallelize_module(layer, mesh["tp"], plan)
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    return model


def optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def step(model, optim, seed: int) -> float:
    """One training step on a batch from `seed` (the same on every rank): the loss."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 66, (4, 8), generator=g)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.item()


def full(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def full_state(model, optim) -> dict:
    """Every parameter, buffer and optimizer state as a full tensor (collective)."""
    out = {f"param:{n}": full(p).detach().clone() for n, p in model.named_parameters()}
    out.update({f"buffer:{n}": full(b).clone() for n, b in model.named_buffers()})
    for n, p in model.named_parameters():
        for key, value in optim.state.get(p, {}).items():
            out[f"state:{n}:{key}"] = full(value).detach().clone() if isinstance(value, torch.Tensor) else value
    return out


def state_differences(expected: dict, got: dict) -> list:
    """Names whose values differ (tensors bit for bit), and names in one state only."""
    differ = [k for k in expected if k in got and not (torch.equal(got[k], expected[k])
                                                       if isinstance(got[k], torch.Tensor) else got[k] == expected[k])]
    return sorted(differ + list(set(expected) ^ set(got)))


def run_moves(rank: int, moves, family: str = "llama") -> dict:
    """For each (source, targets) of `moves`: train the source 2 steps, reshard it into each
    target (the source is only read), record what differs from the source's state and
    two more steps' losses beside the source's own. {(source, target): {"differ", "loss",
    "sent", "bound", "verified", "nir" (rank 0), "names"}}."""
    from nereus.interop import reshard_module

    out = {}
    for source, targets in moves:
        src = build(source, family=family)
        src_optim = optimizer(src)
        for s in range(2):
            step(src, src_optim, s)
        expected = full_state(src, src_optim)
        losses = {}
        for target in targets:
            dst = build(target, meta=True, family=family)
            dst_optim = optimizer(dst)
            report = reshard_module(src, src_optim, dst, dst_optim)
            got = full_state(dst, dst_optim)
            # two steps: the second's loss shows that dst_optim updates dst's own parameters
            losses[target] = (step(dst, dst_optim, 2), step(dst, dst_optim, 3))
            out[(source, target)] = {"differ": state_differences(expected, got), "names": sorted(got),
                                     "sent": report.bytes_sent, "bound": report.lower_bound_bytes,
                                     "verified": report.verified, "nir": report.nir if rank == 0 else None}
        reference = (step(src, src_optim, 2), step(src, src_optim, 3))
        for target in targets:
            out[(source, target)]["loss"] = (losses[target], reference)
    return out


def check_move(found: dict) -> None:
    """The assertions every move must pass (run_moves' entry of one rank)."""
    assert not found["differ"], f"not bit-exact: {found['differ'][:5]}"
    assert found["verified"]
    assert found["sent"] <= found["bound"], (found["sent"], found["bound"])
    losses, references = found["loss"]
    for loss, reference in zip(losses, references):
        assert abs(loss - reference) <= 1e-5 * abs(reference), (losses, references)

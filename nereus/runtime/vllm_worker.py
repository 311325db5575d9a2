"""A vLLM worker extension (vLLM's `worker_extension_cls`): extra methods on every vLLM
worker, called by name through `LLM.collective_rpc`.

Used when vLLM's engine core runs in another process than the Nereus rank (a torchrun
rank already has its own torch.distributed world, and vLLM's worker needs its own):
collective_rpc's message codec turns tensors in untyped arguments into nested lists, so
the weights travel as one `torch.save` byte payload and are rebuilt in the worker, then
loaded through the worker's public `reload_weights` (the model's `load_weights` plus its
post-load processing). Imported by vLLM inside its worker processes, never by Nereus.
"""

from __future__ import annotations

import io

import torch


def pack_weights(items: list) -> bytes:
    """[(vLLM name, tensor)] → bytes (tensors made contiguous on the CPU)."""
    buffer = io.BytesIO()
    torch.save([(name, t.detach().to("cpu").contiguous()) for name, t in items], buffer)
    return buffer.getvalue()


def unpack_weights(payload: bytes) -> list:
    """The inverse of pack_weights; tensors only (weights_only load, no code runs)."""
    return torch.load(io.BytesIO(payload), weights_only=True)


class NereusWorkerExtension:
    """Mixed into vLLM's worker class; `self` is the worker."""

    def nereus_load_weights(self, payload: bytes) -> int:
        """Load a pack_weights payload in checkpoint format; returns the tensor count."""
        items = unpack_weights(payload)
        self.reload_weights(weights_iterator=iter(items))
        return len(items)

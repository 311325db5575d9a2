"""The model evaluations of the RL loop's step on this rank's shards (RlTrainer inherits
them): a model-stage's local weights by local name (gathered per layer under `zero 3`),
forward passes of each DP replica's rows assembled into whole-batch tensors on every
rank, and one minibatch update of a training model-stage (forward and backward through
its pipeline, DP gradient all-reduce or, under zero, reduce-scatter, Adam on the
runtime's tensors).

Input: the trainer's module, runtime, roles (nereus.rl.topology) and the step's sequences
(`_seqs`) and left-pad counts (`_pad`). Output: tensors and losses identical on every rank.
Invariant: exchanging rows between model-stages of different DP degrees is one world
all-reduce per tensor in which TP rank 0 of the replica's last stage writes its rows into
zeros (x + 0 is exact), so every rank gets the same bytes whatever the layout.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from nereus.models.llama import local_logits, values
from nereus.models.parallel import vocab_parallel_logprob
from nereus.runtime.state import TORCH_DTYPES, step_name

from . import pipeline
from .optim import adam_step, all_reduce_grads, reduce_replicated_kv_grads
from .topology import Role
from .zero import gathered_weights, local_weight_shapes, zero_adam_step
from .zero3 import LayerGather, reduce_scatter_chunks


class StageCompute:
    """Needs `module`, `rt`, `roles`, `w` (the workload), `world`, `device`, `cfg` (RlConfig)."""

    def weights(self, ms: str, state: Optional[dict] = None, whole: bool = False):
        """Local weights of a model-stage by local name (what the llama reads), on the
        device (an offloaded model-stage's are copied up from host memory for the stage).
        Under `zero 3` the runtime holds dp chunks: a LayerGather that all-gathers them
        one layer at a time as the forward reads them (nereus.rl.zero3), or with `whole`
        every weight at once (the weight sync reads whole shards; nereus.rl.zero.
        gathered_weights). Collective over the dp group there."""
        prefix = ms.partition(".")[0] + "/"
        state = self.rt.device_state(ms) if state is None else state
        role = self.roles.get(ms)
        if role is not None and role.zero >= 3:
            if not whole:
                return self._layer_gather(ms, state, role)
            model = self.module.model(ms.partition(".")[0])
            state = gathered_weights(state, local_weight_shapes(model, role), TORCH_DTYPES[model.dtype], self.device,
                                     replica=role.replica, dp=role.dp, group=role.dp_group, dp_ranks=role.dp_ranks)
        return {k[len(prefix):]: v for k, v in state.items() if "#" not in k}

    def _layer_gather(self, ms: str, state: dict, role: Role, grad: bool = False) -> LayerGather:
        """Zero 3: this replica's chunks of `ms`'s weights as a per-layer gathering Mapping;
        with `grad`, its backward reduce-scatters each layer's gradients (the replicated
        KV rows summed over TP first, as `_train` does for the other layouts)."""
        model = self.module.model(ms.partition(".")[0])
        prefix = model.name + "/"
        shapes = {k[len(prefix):]: v for k, v in local_weight_shapes(model, role).items()}
        chunks = {k: state[prefix + k] for k in shapes if prefix + k in state}
        before = (lambda grads: reduce_replicated_kv_grads(grads, model, role.tp)) if grad else None
        return LayerGather(chunks, shapes, TORCH_DTYPES[model.dtype], self.device, replica=role.replica, dp=role.dp,
                           group=role.dp_group, dp_ranks=role.dp_ranks, grad=grad, before_reduce=before)

    # -- communication helpers -----------------------------------------------------------

    def _assemble(self, chunk: Optional[torch.Tensor], role: Optional[Role], rows, shape, dtype) -> torch.Tensor:
        full = torch.zeros(shape, dtype=dtype, device=self.device)
        if role is not None and role.contributes and chunk is not None:
            full[rows] = chunk.detach().to(dtype)
        if self.world > 1:
            dist.all_reduce(full)
        return full

    def _per_replica(self, ms: str, fn, shape, dtype=torch.float32, offset: int = 0, batch: Optional[int] = None):
        """Run fn(role, rows) on this rank's replica rows of a model-stage and assemble."""
        role = self.roles.get(ms)
        rows = role.rows(batch or self.w.batch, offset) if role else None
        with torch.no_grad():
            chunk = fn(role, rows) if role else None
        return self._assemble(chunk, role, rows, shape, dtype)

    # -- model evaluations ---------------------------------------------------------------

    def _forward(self, model_name: str, w, tokens, role: Role, head, rows=None):
        """head(final hidden) on the replica's last stage, None on its other stages; `rows`
        of the step's batch (their prompts' pad counts), None: the whole batch."""
        out, _, _ = pipeline.forward(self.module.model(model_name), w, tokens, role.tp, role.pipe, head, ep=role.ep,
                                     pad=self._pad_of(rows))
        return out

    def _pad_of(self, rows):
        """The step's left-pad counts of `rows` (None when no prompt is padded)."""
        pad = getattr(self, "_pad", None)
        return None if pad is None else (pad if rows is None else pad[rows])

    def _logprob_head(self, model_name: str, w, seqs, tp):
        p, vocab = self.w.prompt, self.module.model(model_name).vocab
        return lambda h: vocab_parallel_logprob(local_logits(w, h[:, p - 1:], tp), seqs[:, p:], vocab, tp)

    def _logprobs(self, model_name: str, w, rows, role: Role):
        seqs = self._seqs[rows]
        return self._forward(model_name, w, seqs[:, :-1], role, self._logprob_head(model_name, w, seqs, role.tp), rows)

    def _values(self, model_name: str, w, rows, role: Role):
        return self._forward(model_name, w, self._seqs[rows][:, :-1], role,
                             lambda h: values(w, h[:, self.w.prompt - 1:]).float(), rows)

    def _train(self, ms: str, loss_head, step: int, lr: float, offset: int, mb: int) -> float:
        """One minibatch update of a training model-stage (forward and backward through
        its pipeline, DP gradient all-reduce or, under zero, reduce-scatter, Adam); returns
        the global loss.

        loss_head(params, role, rows) → a function of the final hidden states → loss."""
        role = self.roles.get(ms)
        part = None
        if role is not None:
            state = self.rt.device_state(ms)
            model_name = ms.partition(".")[0]
            model = self.module.model(model_name)
            rows = role.rows(mb, offset)
            if role.zero >= 3:  # weights gathered per layer; gradients reduce-scattered per layer in the backward
                params = self._layer_gather(ms, state, role, grad=True)
                with params.saving():
                    loss, x_in, y = pipeline.forward(model, params, self._seqs[rows][:, :-1], role.tp, role.pipe,
                                                     loss_head(params, role, rows), ep=role.ep, pad=self._pad_of(rows))
                pipeline.backward(role.pipe, loss, x_in, y)
                grads = {f"{model_name}/{k}": g for k, g in params.finish().items()}
            else:
                params = {k: t.detach().requires_grad_() for k, t in self.weights(ms, state).items()}
                loss, x_in, y = pipeline.forward(model, params, self._seqs[rows][:, :-1], role.tp, role.pipe,
                                                 loss_head(params, role, rows), ep=role.ep, pad=self._pad_of(rows))
                pipeline.backward(role.pipe, loss, x_in, y)
                grads = {f"{model_name}/{k}": (p.grad if p.grad is not None else torch.zeros_like(p)).float()
                         for k, p in params.items()}
                reduce_replicated_kv_grads(grads, model, role.tp)
            if role.zero:
                if role.zero < 3:  # zero 1: each replica receives only its chunk of the dp sums
                    grads = reduce_scatter_chunks(grads, role.replica, role.dp, role.dp_group, role.dp_ranks)
                # this replica's chunk of the optimizer state (zero 1: then the weights all-gathered)
                names = list(local_weight_shapes(model, role))  # global names
                zero_adam_step(state, grads, names, step, lr, self.cfg.betas, self.cfg.eps, zero=role.zero,
                               replica=role.replica, dp=role.dp, group=role.dp_group, dp_ranks=role.dp_ranks)
            else:
                # dense gradients over the dp·ep data-parallel ranks, an expert's over the dp
                # replicas holding it (every EP rank's tokens already reached it by all-to-all)
                experts = {n: g for n, g in grads.items() if ".mlp.experts." in n}
                all_reduce_grads({n: g for n, g in grads.items() if n not in experts}, role.dp_group)
                all_reduce_grads(experts, role.expert_dp_group if role.ep.size > 1 else role.dp_group)
                adam_step(state, grads, step, lr, self.cfg.betas, self.cfg.eps)
            counter = step_name(model_name)
            if counter in state:  # the runtime's Adam step counter travels with the state
                state[counter].fill_(step)
            self.rt.write_back(ms, state)  # an offloaded model-stage's state goes back to host memory
            part = loss.detach() if loss is not None else None
        return float(self._assemble(part, role, (), (), torch.float64))

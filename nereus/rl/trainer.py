"""The PPO / GRPO loop: every model-stage computes on the shards the runtime holds.

Model-stages (names fixed by this loop; the plan places them):
  actor.generation   rollout (engine; weights synced from actor.training after each step by
                     Nereus' compiled weight sync, nereus.runtime.vllm_sync). `TrainSpec.engine`
                     picks the engine: "native" (the TP/PP llama on shards Nereus holds) or
                     "vllm" (one vLLM engine per generation replica on its driver rank; the
                     sync targets the engines' input layout and VllmGeneration.push loads it;
                     Nereus then holds no actor.generation shards: the engines do)
  ref.inference      log π_ref (initialised as a copy of the actor's initial weights:
                     seeded, or the actor's Hugging Face checkpoint, nereus.rl.weights)
  reward.inference   optional llama reward model: its score is logged as `rm_score` (None
                     without one); the training reward is always the task's rule
                     (nereus.rl.reward, `--task`), so learning is checkable
  actor.training     log π_old (before the update), then the clipped-objective update
  critic.training    values (PPO only), then the clipped value-loss update

One step: prompts → generation (each DP replica its rows) → inference and old log-probs
→ advantages on the whole batch (every rank has it) → `minibatches` updates with DP
gradient all-reduce and Adam on the runtime's tensors (under `zero 1`/`zero 3` the gradients
are reduce-scattered and each dp replica updates its chunk of the optimizer state,
nereus.rl.zero; `zero 3` gathers the weights one layer at a time, nereus.rl.zero3) → actor weights synced to the
generation stage. At step boundaries a scripted event calls `runtime.transition(plan)`;
the next step reads the new shards and the new groups.

The model evaluations (forward per replica, assembled batches, the minibatch update) are
nereus.rl.stage_compute's; where prompts and rewards come from, nereus.rl.tasks'; the
checkpoints and resume, nereus.rl.persist's.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from nereus.ir.diagnostics import SemanticError
from nereus.ir.model import Module
from nereus.models.llama import values

from . import algorithms as alg
from .checks import check_batch, check_models, check_replicas, check_stages
from .engine import ENGINES, GenerationEngine, NativeEngine, make_vllm_generation
from .faults import kill_here, kill_spec
from .restart import RestartRuntime
from .stage_compute import StageCompute
from .tasks import BuiltinTask, TextTask
from .topology import Groups, Role
from .weights import register_initial_weights


@dataclass(frozen=True)
class TrainSpec:
    plan: str
    steps: int
    events: tuple[tuple[int, str], ...] = ()  # (after step, plan)
    seed: int = 0
    task: str = "pattern"
    rl: alg.RlConfig = field(default_factory=alg.RlConfig)
    controller: bool = False  # let the Nereus controller pick among the declared plans
    drift: tuple[tuple[int, str], ...] = ()  # (after step, "workload.response=12")
    engine: str = "native"  # rollout engine: "native" | "vllm" (see nereus.rl.engine)
    greedy: bool = False  # argmax decoding (exact in both engines) instead of sampling
    workdir: str = ""  # vllm: where each engine's start-up checkpoint goes (default: a temp dir)
    # a text dataset (nereus.rl.tasks.TextTask): prompts file, tokenizer folder, reward
    # function "module:function"; empty prompts: the built-in `task` on token ids
    prompts: str = ""
    tokenizer: str = ""
    reward: str = ""
    samples_every: int = 1  # samples of every N-th step go to the emit callback (0: none)
    # checkpoints (nereus.rl.persist): OUT (empty: none), save every N steps (and the last
    # step), keep the last K, and the checkpoint directory to resume from (empty: a fresh start)
    out: str = ""
    save_every: int = 0
    keep: int = 3
    resume: str = ""


@dataclass(frozen=True)
class StepRecord:
    step: int
    plan: str
    loss: float
    value_loss: float
    reward: float
    kl: float
    rm_score: Optional[float]  # None when the workload has no reward model
    seconds: float
    response: int = 0
    stage_seconds: dict = field(default_factory=dict)  # model-stage → wall seconds of its phase
    sync_bytes: int = 0  # weight sync actor.training → actor.generation, bytes this rank sent
    rollout_sha256: str = ""  # digest of the step's [batch, response] tokens (compare engines)
    response_length: float = 0.0  # mean tokens per response up to and with its eos (= response without one)
    reward_seconds: float = 0.0  # the reward (the task's rule, or the reward function on rank 0 and its broadcast)
    sync_seconds: float = 0.0  # the weight sync actor.training → actor.generation (in stage_seconds' generation too)


def _report_dict(report: Any) -> dict:
    if isinstance(report, dict):
        return dict(report)
    try:
        return asdict(report)
    except TypeError:
        return {k: v for k, v in vars(report).items() if isinstance(v, (int, float, str))}


def weights_sha256(full: dict[str, torch.Tensor]) -> str:
    """sha256 over (name, bytes) of the weights (no optimizer state) in name order."""
    digest = hashlib.sha256()
    for name in sorted(n for n in full if "#" not in n):
        digest.update(name.encode())
        digest.update(full[name].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class _PhaseClock:
    """Accumulates wall seconds per model-stage phase of a step."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._t = time.perf_counter()

    def restart(self) -> None:
        self._t = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self._t
        self._t = now


class RlTrainer(StageCompute):
    """Runs `spec.steps` steps on `runtime` (a nereus Runtime or the restart baseline)."""

    def __init__(self, module: Module, runtime, spec: TrainSpec, emit: Callable[[dict], None] = lambda e: None):
        self.module, self.rt, self.spec, self.emit = module, runtime, spec, emit
        self.cfg, self.w = spec.rl, module.workload
        self.stages = {str(ms) for ms in module.workload.model_stages()}
        check_stages(module, self.cfg.algo)
        check_models(module, text=bool(spec.prompts))
        check_batch(module, self.cfg.algo, self.cfg.minibatches, self.cfg.group)
        check_replicas(module, self.cfg.minibatches)
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.device = getattr(runtime, "device", None) or torch.device("cpu")
        self.groups = Groups()
        self.weight_sync = None
        self.vllm = None  # VllmGeneration when spec.engine == "vllm"
        if spec.engine not in ENGINES:
            raise SemanticError(f"unknown generation engine {spec.engine!r}", hint=f"engines: {', '.join(ENGINES)}")
        if spec.engine == "vllm":
            self.vllm = make_vllm_generation(module, spec.plan, seed=spec.seed, workdir=spec.workdir)
        elif not isinstance(runtime, RestartRuntime) and dist.is_initialized():
            # the per-step actor → generation weight sync compiled by Nereus (vllm_sync.py);
            # the restart baseline keeps gather-everything-then-slice
            from nereus.runtime.vllm_sync import WeightSync

            self.weight_sync = WeightSync(module, device=self.device)
        self.plan_name = spec.plan
        group = self.cfg.group if self.cfg.algo == "grpo" else 1
        self.task = TextTask(spec.prompts, spec.tokenizer, spec.reward, spec.seed, self.w.prompt, group,
                             module.model("actor").vocab) if spec.prompts else BuiltinTask(spec.task, group)
        self.position = 0  # dataset rows consumed by the steps so far (TextTask)
        self.drift_applied: list[str] = []  # the --drift overrides applied so far, in order (checkpoints)
        self.start_step = 1  # > 1 when resumed from a checkpoint
        self.sources: dict = {}  # model -> checkpoint directory it started from (None: seeded), set by initialise
        self.roles = self.groups.for_plan(module, module.plan(spec.plan), self.world)
        from .persist import Persistence

        self.persist = Persistence(self, spec.out, spec.save_every, spec.keep, spec.resume)

    # -- state ---------------------------------------------------------------------------

    def initialise(self) -> None:
        """Every model-stage's initial shards, registered (nereus.rl.weights: a model
        declared hf("dir") reads this rank's boxes of its checkpoint, others are seeded)."""
        stages = [ms for ms in self.stages if not (ms == "actor.generation" and self.vllm is not None)]
        if self.spec.resume:  # the checkpoint's state, in this run's plan (nereus.rl.resume)
            self.start_step = self.persist.restore() + 1
            return
        # with vLLM the engines hold the generation weights (started below)
        self.sources = register_initial_weights(self.rt, self.module, stages, self.spec.seed)
        if self.vllm is not None:  # start the engines from the initial actor weights
            self.vllm.push(self.plan_name, self.rt.state("actor.training"))
            if dist.is_initialized():
                dist.barrier()  # engine start-up (tens of seconds on CPU) is not part of step 1

    # -- one step --------------------------------------------------------------------------

    def step(self, step: int) -> StepRecord:
        start = time.perf_counter()
        cfg, B, R, P = self.cfg, self.w.batch, self.w.response, self.w.prompt
        gen = torch.Generator().manual_seed(self.spec.seed * 1_000_003 + step)
        batch = self.task.batch(B, P, self.position, gen)
        self.position += self.task.consumed(B)
        uniforms = torch.rand(B, R, generator=gen).to(self.device)
        prompts = batch.ids.to(self.device)
        self._pad = batch.pad.to(self.device) if batch.pad is not None else None

        clock = _PhaseClock()
        responses, mask = self.task.finish(self._rollout(prompts, uniforms))
        clock.lap("actor.generation")
        mask = mask.to(self.device) if mask is not None else None
        seqs = self._seqs = torch.cat([prompts, responses], dim=1)
        logp_ref = self._per_replica("ref.inference", lambda role, rows: self._logprobs(
            "ref", self.weights("ref.inference"), rows, role), (B, R))
        clock.lap("ref.inference")
        rm = None  # the reward model's score, logged; the training reward is the task's rule
        if "reward.inference" in self.stages:
            rm_weights = self.weights("reward.inference")
            rm = self._per_replica("reward.inference", lambda role, rows: self._forward(
                "reward", rm_weights, seqs[rows], role, lambda h: values(rm_weights, h[:, -1]).float(), rows), (B,))
            clock.lap("reward.inference")
        logp_old = self._per_replica("actor.training", lambda role, rows: self._logprobs(
            "actor", self.weights("actor.training"), rows, role), (B, R))
        clock.lap("actor.training")
        scoring = time.perf_counter()
        rule = self.task.rewards(batch, responses.cpu(), step).to(self.device)
        reward_seconds = time.perf_counter() - scoring
        if self.spec.samples_every and step % self.spec.samples_every == 0 and self._rank() == 0:
            texts = self.task.texts(batch, responses.cpu())
            self.emit({"event": "samples", "step": step, "prompts": texts[0], "responses": texts[1],
                       "rewards": rule.tolist()})
        clock.restart()  # (stage_seconds are model-stages': the controller reads them)
        if cfg.algo == "ppo":
            v_old = self._per_replica("critic.training", lambda role, rows: self._values(
                "critic", self.weights("critic.training"), rows, role), (B, R))
            clock.lap("critic.training")
            adv, returns = alg.ppo_advantages(rule, logp_old, logp_ref, v_old, cfg, mask)
        else:
            adv = alg.grpo_advantages(rule, cfg.group, R)

        mb = B // cfg.minibatches
        losses, value_losses = [], []
        for m in range(cfg.minibatches):
            offset, opt_step = m * mb, (step - 1) * cfg.minibatches + m + 1
            part = mask[offset:offset + mb] if mask is not None else None
            tokens = max(1, int(part.sum())) if part is not None else mb * R

            def actor_loss(params, role, rows):
                logprob = self._logprob_head("actor", params, seqs[rows], role.tp)
                keep = mask[rows] if mask is not None else None

                def head(h):
                    logp = logprob(h)
                    loss = alg.policy_loss(logp, logp_old[rows], adv[rows], cfg.clip, tokens, keep)
                    if cfg.algo == "grpo":
                        loss = loss + cfg.kl_coef * alg.masked_sum(alg.kl_k3(logp, logp_ref[rows]), keep) / tokens
                    return loss
                return head

            clock.restart()
            losses.append(self._train("actor.training", actor_loss, opt_step, cfg.lr, offset, mb))
            clock.lap("actor.training")
            kill_here("step", step, self._rank(), self.persist.close)  # crash tests: the state is half updated here
            if cfg.algo == "ppo":
                def critic_loss(params, role, rows):
                    keep = mask[rows] if mask is not None else None
                    return lambda h: alg.value_loss(values(params, h[:, self.w.prompt - 1:]).float(), v_old[rows],
                                                    returns[rows], cfg.value_clip, tokens, keep)

                value_losses.append(self._train("critic.training", critic_loss, opt_step, cfg.critic_lr, offset, mb))
                clock.lap("critic.training")
        clock.restart()
        syncing = time.perf_counter()
        sync_bytes = self.sync_generation_weights()
        sync_seconds = time.perf_counter() - syncing
        clock.lap("actor.generation")
        kl = logp_old - logp_ref
        return StepRecord(step, self.plan_name, sum(losses) / len(losses),
                          sum(value_losses) / len(value_losses) if value_losses else 0.0,
                          float(rule.mean()), float(kl.mean()) if mask is None else float((kl * mask).sum() / mask.sum()),
                          float(rm.mean()) if rm is not None else None,
                          time.perf_counter() - start, R, clock.seconds, sync_bytes,
                          hashlib.sha256(responses.cpu().numpy().tobytes()).hexdigest(),
                          float(R) if mask is None else float(mask.sum(dim=1).mean()), reward_seconds, sync_seconds)

    def _rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    def _engine(self, role: Optional[Role]) -> Optional[GenerationEngine]:
        """The engine that generates this rank's replica rows, None where the rank writes
        none (vllm: ranks that drive no engine; tokens come from the driver alone)."""
        if self.vllm is not None:
            return self.vllm.engine
        if role is None:
            return None
        return NativeEngine(self.module.model("actor"), lambda: self.weights("actor.generation"), role.tp, role.pipe,
                            role.ep)

    def _rollout(self, prompts: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
        """[B, R] response tokens of the whole batch on every rank. Each generation replica
        generates its rows; the rank that holds them (native: last pipeline stage, TP rank
        0; vllm: the engine's driver) writes them into the assembled batch."""
        B, R = self.w.batch, self.w.response
        role = self.roles.get("actor.generation")
        engine = self._engine(role)
        rows = role.rows(B) if role is not None else None
        tokens = None
        if engine is not None:
            with torch.no_grad():
                tokens = engine.generate(prompts[rows], R, uniforms[rows], self.cfg.temperature, self.spec.greedy,
                                         self._pad_of(rows))
        writes = tokens is not None and (self.vllm is not None or role.contributes)
        full = torch.zeros((B, R), dtype=torch.long, device=self.device)
        if writes:
            full[rows] = tokens.to(self.device)
        if self.world > 1:
            dist.all_reduce(full)
        return full

    def sync_generation_weights(self) -> int:
        """Copy the trained actor weights into the generation stage's shards (in place);
        returns the bytes this rank sent. With vLLM: the compiled sync into the engines'
        input layout, then each driver loads the weights into its engine."""
        if self.vllm is not None:
            return self.vllm.push(self.plan_name, self.rt.state("actor.training")).bytes_sent
        if self.weight_sync is not None:  # the sync reads whole TP/PP shards: gathered under zero 3
            result = self.weight_sync.run(self.plan_name, {f"actor/{k}": v for k, v in
                                                           self.weights("actor.training", whole=True).items()})
            local, sent = result.weights, result.bytes_sent
        else:
            full = self.rt.gather_state_dict("actor.training")
            local = self.rt.shard_state_dict("actor.generation", {k: v for k, v in full.items() if "#" not in k})
            sent = sum(t.numel() * t.element_size() for t in full.values())  # each rank all-reduces all
        for name, tensor in self.rt.state("actor.generation").items():
            tensor.copy_(local[name])  # a copy: kept shards of the sync alias training tensors
        return sent

    # -- the run ----------------------------------------------------------------------------

    def apply_drift(self, override: str) -> None:
        """Change a workload value from the next step on (e.g. longer responses)."""
        import nereus.ir as ir

        self.module = ir.apply_overrides(self.module, [override])
        self.drift_applied.append(override)
        self.w = self.module.workload
        check_batch(self.module, self.cfg.algo, self.cfg.minibatches, self.cfg.group)
        check_replicas(self.module, self.cfg.minibatches)

    def transition(self, after_step: int, plan: str) -> dict:
        start = time.perf_counter()
        hook = {}
        if kill_spec() is not None and not isinstance(self.rt, RestartRuntime):  # crash tests (nereus.rl.faults)
            hook["round_hook"] = lambda index: kill_here("transition", after_step, self._rank(), self.persist.close)
        report = _report_dict(self.rt.transition(plan, **hook))
        self.roles = self.groups.for_plan(self.module, self.module.plan(plan), self.world)
        engine_seconds, engine_moved = 0.0, False
        if self.vllm is not None:  # engines follow the new generation layout (restarted where moved)
            followed = time.perf_counter()
            engine_moved = self.vllm.follow(plan, self.rt.state("actor.training")) is not None
            engine_seconds = time.perf_counter() - followed
        # an engine restart (a vLLM start-up, tens of seconds) is no part of the transition:
        # counted apart as engine_seconds (it was 95.67% of a run's "transition share")
        record = {"after_step": after_step, "from": self.plan_name, "to": plan,
                  "seconds": time.perf_counter() - start - engine_seconds,
                  "bytes": int(report.get("total_bytes_sent", report.get("bytes", 0)) or 0),
                  "runtime_seconds": float(report.get("max_seconds", report.get("seconds", 0.0))),
                  "compile_seconds": float(report.get("compile_s", 0.0)), "engine_seconds": engine_seconds,
                  "engine_moved": engine_moved}
        self.plan_name = plan
        return record

    def close(self) -> None:
        """Stop the generation engines (vllm); idempotent."""
        if self.vllm is not None:
            self.vllm.close()

    def run(self) -> dict:
        """Initialise, train, apply events; returns the result dict (same on every rank).
        The vLLM engines are stopped at the end, also on errors."""
        try:
            return self._run()
        finally:
            self.close()

    def _run(self) -> dict:
        self.initialise()
        events, drift = dict(self.spec.events), {}
        for step, override in self.spec.drift:  # several changes after one step: all, in order
            drift.setdefault(step, []).append(override)
        steps, transitions = [], []
        policy = None
        if self.spec.controller:
            from .adaptive import ControllerPolicy
            from .topology import runnable

            ok = tuple(p.name for p in self.module.plans if runnable(self.module, p, self.world))
            policy = ControllerPolicy(self.module, self.plan_name, self.spec.steps, ok)
        run_start = time.perf_counter()
        for i in range(self.start_step, self.spec.steps + 1):
            record = self.step(i)
            ran_under = self.w
            steps.append(record)
            self.emit({"event": "step", **asdict(record)})
            for override in drift.get(i, ()):
                self.apply_drift(override)
                self.emit({"event": "drift", "after_step": i, "set": override})
            if i < self.spec.steps:
                target = events.get(i)
                if policy is not None:
                    policy.observe(self.module, self.plan_name, ran_under, record.stage_seconds, record.seconds)
                    target = policy.decide(i + 1, self.w, self.world) or target
                    self.emit({"event": "decision", "step": i, **(policy.decisions[-1] or {})})
                if target is not None and target != self.plan_name:
                    transitions.append(self.transition(i, target))
                    if policy is not None:
                        policy.transitioned(self.module, target, transitions[-1]["seconds"], i + 1)  # before step i + 1
                    self.emit({"event": "transition", **transitions[-1]})
            self.persist.boundary(i, i == self.spec.steps)
        self.persist.close()
        final = {ms: self.rt.gather_state_dict(ms) for ms in sorted(self.stages) if ms.endswith(".training")}
        merged = {k: v for full in final.values() for k, v in full.items()}
        return {"name": "train", "algo": self.cfg.algo, "plan": self.spec.plan, "final_plan": self.plan_name,
                "steps": [asdict(s) for s in steps], "transitions": transitions,
                "run_seconds": time.perf_counter() - run_start,
                "decisions": policy.decisions if policy is not None else [], "initial_weights": self.sources,
                "checkpoints": self.persist.report(), "resumed": self.persist.resumed,
                "final_weights_sha256": weights_sha256(merged), "_final_state": merged}

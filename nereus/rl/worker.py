"""The per-process entry point `nereus train` starts under torchrun.

    python -m torch.distributed.run --nproc-per-node N -m nereus.rl.worker CONFIG.json

Rank 0 prints one `@nereus-rl {json}` line per step and transition (the launcher turns
them into a progress bar), writes the samples and metrics (nereus.rl.metrics) under the
run's output folder and, at the end, writes RUN/result.json and RUN/final_state.pt (the
full trained state, for comparisons). Checkpoints (nereus.rl.checkpoint) go to
OUTPUT/checkpoints/step_N, each rank writing its own shards; `resume` in the config names
the checkpoint directory to start from.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from dataclasses import fields
from typing import Optional

import torch
import torch.distributed as dist

from nereus.ir.diagnostics import NereusError, SettingError

from .algorithms import RlConfig
from .topology import collective_timeout
from .trainer import RlTrainer, TrainSpec

PREFIX = "@nereus-rl "


def make_runtime(kind: str, path: str, plan: str, module):
    """`nereus`: the Nereus runtime (compiled transitions); `restart`: gather-and-reshard."""
    if kind == "restart":
        from .restart import RestartRuntime

        return RestartRuntime(module, plan, _device())
    import nereus.runtime as nr

    return nr.Runtime.from_file(path, plan=plan)


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_LOG = None  # rank 0's RunLog (samples, metrics), set by run()
_QUIET = ("samples", "decision", "checkpoint")  # events for the log only, not the launcher


def _emit(event: dict) -> None:
    _injected_fault(event)
    if not dist.is_initialized() or dist.get_rank() == 0:
        if _LOG is not None:
            _LOG.event(event)
        if event.get("event") not in _QUIET:
            print(PREFIX + json.dumps(event), flush=True)


def step_fault() -> Optional[tuple[int, int]]:
    """Tests: NEREUS_STEP_FAULT="rank:step" (that rank raises after that step), or None;
    a SettingError naming the variable for anything else."""
    spec = os.environ.get("NEREUS_STEP_FAULT", "").strip()
    if not spec:
        return None
    try:
        rank, step = map(int, spec.split(":"))
    except ValueError:
        raise SettingError(f"NEREUS_STEP_FAULT={spec!r}: must be RANK:STEP",
                           hint="tests inject a failure there, e.g. 1:2 (rank 1 raises after step 2)") from None
    return rank, step


def _injected_fault(event: dict) -> None:
    """Tests: NEREUS_STEP_FAULT="rank:step" makes that rank raise after that step."""
    spec = step_fault()
    if spec and event.get("event") == "step" and dist.is_initialized():
        rank, step = spec
        if dist.get_rank() == rank and event.get("step") == step:
            raise RuntimeError(f"injected fault on rank {rank} after step {step}")


def _fail(error: BaseException, code: int, out: str = "") -> None:
    """Any rank that raises: report its error and traceback as an event (every rank, not
    only rank 0, so the launcher sees the root cause) and leave at once. The full event
    goes to OUT/error-rank<r>.json and a short line naming it to stdout in one write
    (atomic in a pipe, so ranks' lines never interleave). No destroy_process_group: a
    peer may wait in a collective, and the teardown would wait with it; once this
    process is gone torchrun stops the others."""
    # (before the group exists, torchrun's RANK)
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", -1))
    event = {"event": "error", "rank": rank, "type": type(error).__name__, "time": time.time(),
             "user_error": isinstance(error, NereusError),
             "message": error.format() if isinstance(error, NereusError) else str(error),
             "traceback": "".join(traceback.format_exception(type(error), error, error.__traceback__))}
    line = event
    if out:
        try:
            os.makedirs(out, exist_ok=True)
            path = os.path.join(out, f"error-rank{rank}.json")
            with open(path, "w") as f:
                json.dump(event, f)
            line = {"event": "error", "rank": rank, "time": event["time"], "file": path}
        except OSError:
            pass
    sys.stdout.flush()
    os.write(1, (PREFIX + json.dumps(line) + "\n").encode())
    sys.stderr.flush()
    os._exit(code)


def run(config: dict) -> dict:
    """Train per `config` (see nereus.cli.train for the keys); returns the result dict."""
    import nereus.ir as ir

    torch.manual_seed(config.get("seed", 0))
    module = ir.parse_file(config["plan_file"])
    if config.get("overrides"):
        module = ir.apply_overrides(module, list(config["overrides"]))
    names = {f.name for f in fields(RlConfig)}
    rl = RlConfig(**{k: v for k, v in config.get("rl", {}).items() if k in names})
    output = config.get("output") or ""  # samples, metrics, checkpoints (OUT of `nereus train --out`)
    saving = bool(output) and config.get("checkpoint", True) and config.get("runtime", "nereus") == "nereus"
    spec = TrainSpec(config["plan"], config["steps"], tuple((int(s), p) for s, p in config.get("events", [])),
                     config.get("seed", 0), config.get("task", "pattern"), rl, bool(config.get("controller")),
                     tuple((int(s), o) for s, o in config.get("drift", [])),
                     engine=config.get("engine", "native"), greedy=bool(config.get("greedy", False)),
                     workdir=os.path.join(config["out"], "vllm") if config.get("out") else "",
                     prompts=config.get("prompts") or "", tokenizer=config.get("tokenizer") or "",
                     reward=config.get("reward") or "", samples_every=int(config.get("samples_every", 1)),
                     out=output if saving else "", save_every=int(config.get("save_every", 0)),
                     keep=int(config.get("keep", 3)), resume=config.get("resume") or "",
                     sync=config.get("sync", "dense"), sync_full_every=int(config.get("sync_full_every", 0)))
    global _LOG
    if output and dist.get_rank() == 0:
        from .metrics import RunLog

        resume_step = config.get("resume_step")
        _LOG = RunLog(output, tuple(config.get("loggers", ("jsonl",))), config,
                      resume_step=int(resume_step) if resume_step is not None else None,
                      name=os.path.basename(os.path.abspath(output)))
    try:
        runtime = make_runtime(config.get("runtime", "nereus"), config["plan_file"], config["plan"], module)
        result = RlTrainer(module, runtime, spec, emit=_emit).run()
    finally:
        if _LOG is not None:
            _LOG.close()
            _LOG = None
    final = result.pop("_final_state")
    out = config.get("out")
    if out:
        os.makedirs(out, exist_ok=True)
        if dist.get_rank() == 0:
            torch.save({k: v.cpu() for k, v in final.items()}, os.path.join(out, "final_state.pt"))
            with open(os.path.join(out, "result.json"), "w") as f:
                json.dump(result, f, indent=1)
    return result


def main(argv: list[str]) -> int:
    with open(argv[1]) as f:
        config = json.load(f)
    torch.set_num_threads(max(1, int(config.get("threads", 1))))
    backend = config.get("backend") or ("nccl" if torch.cuda.is_available() else "gloo")
    try:  # joining the group too: torchrun's own dump of a failed start names no error
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        # a peer that stalls without raising (a deadlock, a hung device) ends the job once a
        # collective waits this long: the waiting rank raises and reports, as any failure
        dist.init_process_group(backend, timeout=collective_timeout())
        result = run(config)
        _emit({"event": "done", **result})
        # every rank past its last collective before any leaves: a rank that exits while a
        # peer still has a gloo operation open makes the peer's transport thread throw, and
        # the C++ runtime aborts it (SIGABRT after a finished run, once in CI)
        dist.barrier()
    except NereusError as error:
        _fail(error, 2, config.get("out", ""))
    except BaseException as error:  # noqa: BLE001 - any failure must end the job, not hang it
        _fail(error, 1, config.get("out", ""))
    # everything is written (result, checkpoints: run() waits for its saves): leave without
    # the interpreter's and the process groups' teardown, where a peer's closed connection
    # can still abort this process after its work is done
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv))

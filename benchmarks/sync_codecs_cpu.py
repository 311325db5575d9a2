"""Weight-sync codecs on the bundled CPU GRPO example (examples/rl/grpo-cpu.nir, 2 gloo
processes, its README's command: 150 steps, plan changes after steps 50 and 100):

  delta     `--sync delta` against `--sync dense`, greedy rollouts: the bytes rank 0 sends
            per sync in each (S1's sync is all local copies: 0 bytes either way), and
            whether every step's rollout and the final weights are bit-identical. The
            example as bundled (fp32 weights, README lr 3e-3), and the same actor in bf16
            (`dtype bf16`) at the lr the README gives its bf16 runs (1e-5) and at 1e-6.
  fp8       examples/rl/grpo-fp8-cpu.nir (generation `quant fp8`) against grpo-cpu.nir,
            sampled rollouts as in the README: the reward curve of each (means over
            10-step windows), and the logits of the FP8 generation weights against the
            fp32 ones (|difference| largest and mean, argmax agreement on 512 random
            prompts) for the initial weights and each run's final weights.

    PYTHONPATH=. python benchmarks/sync_codecs_cpu.py --out benchmarks/data/sync_codecs_cpu_DATE
    PYTHONPATH=. python benchmarks/sync_codecs_cpu.py --steps 6 --events "2:S2,4:S3"    # quick

Last stdout line: one JSON object (also OUT/sync_codecs_cpu.json).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(HERE, os.pardir, "examples", "rl", "grpo-cpu.nir")
FP8_EXAMPLE = os.path.join(HERE, os.pardir, "examples", "rl", "grpo-fp8-cpu.nir")


def train(plan_file: str, out: str, steps: int, events: str, *extra: str) -> dict:
    """One `nereus train` run (GRPO, 2 processes); its result.json, with the per-step records."""
    command = [sys.executable, "-m", "nereus.cli", "runtime", "train", plan_file, "--algo", "grpo", "--nproc", "2",
               "--steps", str(steps), "--events", events, "--out", out, "--json", *extra]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    with open(os.path.join(out, "run", "result.json")) as handle:
        result = json.load(handle)
    result["wall_seconds"] = time.perf_counter() - started
    return result


def delta_case(plan_file: str, label: str, lr: float, steps: int, events: str, work: str) -> dict:
    runs = {mode: train(plan_file, os.path.join(work, f"{label}-{mode}"), steps, events, "--sync", mode, "--greedy",
                        "--lr", str(lr)) for mode in ("dense", "delta")}
    dense, delta = runs["dense"]["steps"], runs["delta"]["steps"]
    per_step = [{"step": a["step"], "plan": a["plan"], "dense_bytes": a["sync_bytes"], "delta_bytes": b["sync_bytes"],
                 "full": b["sync_full"], "same_rollout": a["rollout_sha256"] == b["rollout_sha256"]}
                for a, b in zip(dense, delta)]
    after_full = [s for s in per_step if not s["full"] and s["dense_bytes"]]
    return {"plan_file": os.path.basename(plan_file), "lr": lr, "per_step": per_step,
            "rollouts_identical": all(s["same_rollout"] for s in per_step),
            "final_weights_identical": runs["dense"]["final_weights_sha256"] == runs["delta"]["final_weights_sha256"],
            "delta_of_dense_after_full_syncs": (sum(s["delta_bytes"] for s in after_full) /
                                                max(1, sum(s["dense_bytes"] for s in after_full))),
            "delta_of_dense_worst_step": max((s["delta_bytes"] / s["dense_bytes"] for s in after_full), default=None),
            "wall_seconds": {mode: run["wall_seconds"] for mode, run in runs.items()}}


def logits_difference(module, weights: dict, prompts: torch.Tensor) -> dict:
    """FP8 generation weights (the linear layers quantized on the tp 1 grid) against the
    weights themselves: the last position's logits of `prompts`."""
    from nereus.models import llama
    from nereus.models.fp8 import Fp8Weight
    from nereus.models.parallel import TpGroup
    from nereus.models.quant import is_quantized
    from nereus.runtime import fp8

    model = module.model("actor")
    local = {name.partition("/")[2]: t.float() for name, t in weights.items() if name.startswith("actor/")}
    quantized = {}
    for name, tensor in local.items():
        if is_quantized(name):
            codes, scales = fp8.quantize(tensor, 0, 0, 128)
            quantized[name] = Fp8Weight(codes.view(torch.float8_e4m3fn), scales)
        else:
            quantized[name] = tensor
    out = []
    for w in (local, quantized):
        hidden = llama.hidden_states(model, w, prompts, TpGroup())
        out.append(llama.local_logits(w, hidden[:, -1], TpGroup()))
    diff = (out[1] - out[0]).abs()
    return {"max_abs": float(diff.max()), "mean_abs": float(diff.mean()),
            "logit_scale": float(out[0].abs().mean()),
            "argmax_agreement": float((out[1].argmax(-1) == out[0].argmax(-1)).float().mean())}


def fp8_case(steps: int, events: str, work: str) -> dict:
    import nereus.ir as ir
    from nereus.models.llama import init_full_weights

    runs = {label: train(path, os.path.join(work, f"reward-{label}"), steps, events)
            for label, path in (("fp32", EXAMPLE), ("fp8", FP8_EXAMPLE))}
    module = ir.parse_file(EXAMPLE)
    prompts = torch.randint(0, module.model("actor").vocab, (512, module.workload.prompt),
                            generator=torch.Generator().manual_seed(0))
    initial = {f"actor/{k}": v for k, v in init_full_weights(module.model("actor"), torch.Generator().manual_seed(0)).items()}
    logits = {"initial": logits_difference(module, initial, prompts)}
    for label in runs:
        final = torch.load(os.path.join(work, f"reward-{label}", "run", "final_state.pt"))
        logits[f"final_{label}_run"] = logits_difference(module, final, prompts)
    window = 10
    curves = {label: [sum(s["reward"] for s in run["steps"][i:i + window]) / len(run["steps"][i:i + window])
                      for i in range(0, len(run["steps"]), window)] for label, run in runs.items()}
    sync = {label: [s["sync_bytes"] for s in run["steps"]] for label, run in runs.items()}
    return {"reward_per_10_steps": curves, "logits": logits, "sync_bytes_per_step": sync,
            "fp8_of_fp32_sync_bytes": sum(sync["fp8"]) / max(1, sum(sync["fp32"])),
            "wall_seconds": {label: run["wall_seconds"] for label, run in runs.items()}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--events", default="50:S2,100:S3")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="nereus-codecs-") as work:
        bf16 = os.path.join(work, "grpo-bf16-cpu.nir")
        with open(EXAMPLE) as source, open(bf16, "w") as target:
            target.write(source.read().replace("dtype fp32", "dtype bf16"))
        result = {"name": "sync_codecs_cpu", "torch": torch.__version__, "steps": args.steps, "events": args.events,
                  "delta": [delta_case(EXAMPLE, "fp32", 3e-3, args.steps, args.events, work),
                            delta_case(bf16, "bf16-lr1e-5", 1e-5, args.steps, args.events, work),
                            delta_case(bf16, "bf16-lr1e-6", 1e-6, args.steps, args.events, work)],
                  "fp8": fp8_case(args.steps, args.events, work)}
    result["seconds"] = time.perf_counter() - started
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "sync_codecs_cpu.json"), "w") as handle:
            json.dump(result, handle, indent=1)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

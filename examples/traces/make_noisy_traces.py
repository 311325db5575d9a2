"""Build the noisy drift traces (seeded, deterministic; rerun to regenerate).

    python examples/traces/make_noisy_traces.py [--seed S]

With --seed S: the same two drifts with another draw of the noise, written as
length-growth-noisy-1024-seedS.json and mixed-noisy-64-seedS.json (held-out traces: the
controller's settings were not chosen on them).

length-growth-noisy-1024.json — 1,000 steps of GRPO on Llama-3.1-70B, 1,024 GPUs, starting
  from S1. The mean response grows from 1K to 6.5K tokens along the saturating curve of
  make_traces.py (τ = 500 steps), and every step's response is the mean × (1 ± 10%),
  uniform and independent per step: RL batches differ in length from step to step by far
  more than the 1% of the bundled traces.
mixed-noisy-64.json — 400 steps of PPO on Llama-3.1-8B, 64 GPUs, starting from S1, with
  both drifts at once: the GPU schedule of gpu-supply-64.json (64 → 56 → 48 → 64 → 48 → 64)
  and a mean response growing linearly from 1K to 6K tokens, each step × (1 ± 10%).
"""

import json
import math
import os
import random

HERE = os.path.dirname(os.path.abspath(__file__))
NOISE = 0.10
SUPPLY = [(0, 64), (60, 56), (120, 48), (200, 64), (280, 48), (340, 64)]


def noisy(mean: float, rng: random.Random) -> int:
    """mean × (1 ± NOISE), rounded to 16 tokens."""
    return max(16, int(round(mean * (1 + NOISE * (2 * rng.random() - 1)) / 16) * 16))


def length_growth_noisy(steps=1000, tau=500.0, start=1024, end=6656, seed=17):
    rng = random.Random(seed)
    out = []
    for t in range(steps):
        shape = (1 - math.exp(-t / tau)) / (1 - math.exp(-(steps - 1) / tau))
        out.append({"response": noisy(start + (end - start) * shape, rng), "gpus": 1024})
    return out


def mixed_noisy(steps=400, start=1024, end=6144, seed=23):
    rng = random.Random(seed)
    out = []
    for t in range(steps):
        gpus = [g for s, g in SUPPLY if s <= t][-1]
        out.append({"response": noisy(start + (end - start) * t / (steps - 1), rng), "gpus": gpus})
    return out


def write(name, nir, plan, steps, seed, note):
    with open(os.path.join(HERE, name), "w") as handle:
        json.dump({"nir": nir, "plan": plan, "seed": seed, "note": note, "steps": steps}, handle)
        handle.write("\n")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="write the noisy traces; --seed S writes the same two "
                                                 "drifts with other noise as *-seedS.json")
    parser.add_argument("--seed", type=int, help="noise seed (default: the bundled traces' 17 and 23)")
    args = parser.parse_args()
    tag = "" if args.seed is None else f"-seed{args.seed}"
    growth_seed, mixed_seed = (17, 23) if args.seed is None else (args.seed, args.seed)
    write(f"length-growth-noisy-1024{tag}.json", "llama70b-1024.nir", "S1", length_growth_noisy(seed=growth_seed),
          growth_seed, "GRPO 70B, 1,024 GPUs, responses 1K -> 6.5K over 1,000 steps, each step +-10%")
    write(f"mixed-noisy-64{tag}.json", "llama8b-64.nir", "S1", mixed_noisy(seed=mixed_seed), mixed_seed,
          "PPO 8B, 64 GPUs, nodes lost and regained and responses 1K -> 6K, each step +-10%")

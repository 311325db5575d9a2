"""Build the bundled drift traces (deterministic; rerun to regenerate).

    python examples/traces/make_traces.py

length-growth-1024.json — 1,000 steps of GRPO on Llama-3.1-70B, 1,024 GPUs. The mean
  response length grows from 1K to 16K tokens along a saturating curve, r(t) = 1024 + 15360 ·
  (1 − e^(−t/τ))/(1 − e^(−T/τ)), τ = 500 steps, with ±1% seeded step-to-step noise. The
  shape follows published RL length-growth curves: DeepSeek-R1-Zero's average response
  length rises steadily through training (DeepSeek-AI 2025, Fig. 3), and DAPO (Yu et al.
  2025, Fig. 7) and Logic-RL show fast early growth that slows later. Starts from S1
  (the best plan for responses up to 8K; see llama70b-1024.nir).
length-growth-1024-safe.json — the same steps, starting from S2, the best plan for 16K
  responses (a plan chosen to fit the whole run, the conservative fixed baseline).
gpu-supply-64.json — 400 steps of PPO on Llama-3.1-8B, 64 GPUs (8 nodes). Nodes are lost
  and regained, as on a shared or preemptible cluster: 64 GPUs, one node lost at step 60,
  another at 120, both back at 200, two lost at 280, all back at 340. Responses grow
  slowly from 2K to 3K tokens.
"""

import json
import math
import os
import random

HERE = os.path.dirname(os.path.abspath(__file__))


def length_growth(steps=1000, tau=500.0, seed=7):
    rng = random.Random(seed)
    out = []
    for t in range(steps):
        shape = (1 - math.exp(-t / tau)) / (1 - math.exp(-(steps - 1) / tau))
        mean = 1024 + 15360 * shape
        response = int(round(mean * (1 + 0.01 * (2 * rng.random() - 1)) / 16) * 16)
        out.append({"response": response, "gpus": 1024})
    return out


def gpu_supply(steps=400, seed=11):
    rng = random.Random(seed)
    schedule = [(0, 64), (60, 56), (120, 48), (200, 64), (280, 48), (340, 64)]
    out = []
    for t in range(steps):
        gpus = [g for s, g in schedule if s <= t][-1]
        mean = 2048 + 1024 * t / (steps - 1)
        response = int(round(mean * (1 + 0.01 * (2 * rng.random() - 1)) / 16) * 16)
        out.append({"response": response, "gpus": gpus})
    return out


def write(name, nir, plan, steps, seed, note):
    with open(os.path.join(HERE, name), "w") as handle:
        json.dump({"nir": nir, "plan": plan, "seed": seed, "note": note, "steps": steps}, handle)
        handle.write("\n")


if __name__ == "__main__":
    growth = length_growth()
    write("length-growth-1024.json", "llama70b-1024.nir", "S1", growth, 1,
          "GRPO 70B, 1,024 GPUs, responses 1K -> 16K over 1,000 steps; starts from S1 (best up to 8K)")
    write("length-growth-1024-safe.json", "llama70b-1024.nir", "S2", growth, 1,
          "as length-growth-1024.json, starting from S2 (fits the whole run)")
    write("gpu-supply-64.json", "llama8b-64.nir", "S1", gpu_supply(), 2,
          "PPO 8B, 64 GPUs, nodes lost and regained; responses 2K -> 3K")

"""Plan-search time and controller overhead per step.

    PYTHONPATH=. python benchmarks/controller_search.py

1. search time of the 1,024-GPU Llama-70B GRPO case (examples/traces/llama70b-1024.nir) at
   several response lengths (target < 1 s on one core of the 2-core CPU machine);
2. controller overhead per step — decide() + observe() of every model-stage — on the
   64-GPU PPO case over 200 steps of slowly drifting responses, split into steps that ran
   no search (the steady state; target < 10 ms) and the amortised mean including searches.
Last line: one JSON object.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import replace

import nereus.ir as ir
from nereus.controller import Controller, CostModel, search_plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    big = ir.parse_file(os.path.join(ROOT, "examples", "traces", "llama70b-1024.nir"))
    cost = CostModel(big)
    search_s, search_cpu = {}, {}
    for response in (1024, 4096, 8192, 16384):
        w = replace(big.workload, response=response)
        began, began_cpu = time.perf_counter(), time.process_time()
        found = search_plan(big, w, cost, 1024)
        search_s[response] = time.perf_counter() - began
        search_cpu[response] = time.process_time() - began_cpu
        print(f"70B / 1,024 GPUs, response {response:5d}: search {search_s[response]:.3f} s, "
              f"{found.candidates} candidates, {found.leaves} leaves, predicted {found.predicted_s:.1f} s/step")
    small = ir.parse_file(os.path.join(ROOT, "examples", "traces", "llama8b-64.nir"))
    ctl = Controller(small, small.plan("S1"), total_steps=1000, transition_method="estimate")
    steady, every, steady_cpu = [], [], []
    for step in range(200):
        w = replace(small.workload, response=2048 + 4 * step)
        searches = ctl.searches
        began, began_cpu = time.perf_counter(), time.process_time()
        decision = ctl.decide(step, w, 64)
        if decision.switch:
            ctl.transitioned(decision.plan, step=step)
        for placement in ctl.plan.placements:
            ctl.observe(placement.model_stage, ctl.plan, w, 10.0)
        elapsed = time.perf_counter() - began
        every.append(elapsed)
        if ctl.searches == searches:
            steady.append(elapsed)
            steady_cpu.append(time.process_time() - began_cpu)
    result = {"name": "controller_search", "machine": os.uname().nodename, "cpus": os.cpu_count(),
              "search_s_70b_1024": {str(k): round(v, 4) for k, v in search_s.items()},
              "max_search_s": round(max(search_s.values()), 4),
              "search_cpu_s_70b_1024": {str(k): round(v, 4) for k, v in search_cpu.items()},
              "steady_step_ms_median": round(1e3 * statistics.median(steady), 3),
              "steady_step_ms_mean": round(1e3 * statistics.mean(steady), 3),
              "steady_step_cpu_ms_median": round(1e3 * statistics.median(steady_cpu), 3),
              "amortised_step_ms_mean": round(1e3 * statistics.mean(every), 3),
              "loadavg_1min": os.getloadavg()[0],
              "steps": len(every), "searches": ctl.searches}
    print(json.dumps(result))


if __name__ == "__main__":
    main()

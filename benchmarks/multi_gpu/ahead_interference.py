"""What lowering ahead costs the work beside it: a stand-in training loop's step times on one
GPU while the runtime's lowering-ahead thread works, against the same steps once it is done.

    python3 benchmarks/multi_gpu/ahead_interference.py --moe train-ep2-tp2 --layers 6     # 1 GPU

Why: the thread (nereus.runtime.ahead) runs Python beside the training code, in the same
process, under one GIL: while it lowers a transition, builds its replays or compiles a
kernel variant, the training step's own Python (its launches) waits for the GIL whenever
both want it. How much that costs depends on the step: a step whose host mostly waits for
the GPU (large kernels, few launches) loses little; a launch-bound step loses more.

Two kinds of step, alternating, each synchronized at its end: "device" (a chain of 8 bf16
matmuls of 8192 x 8192: ~10 ms of GPU work, 8 launches) and "host" (2000 small tensor ops:
launch-bound). The process joins a fake group as rank 0 of 2 (host_only.py), builds
plan A of the case's module and a Runtime (no state is needed to lower), and runs steps
from right after the Runtime's construction until the thread has nothing left to do, each
marked busy when the thread was at work at both of its ends; then `--steps` more of each
kind with the thread idle. Reported: per kind, the median and max step time busy and idle,
and the thread's busy time. Last stdout line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from host_only import join_fake
from mg_common import machine


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--moe", default="train-ep2-tp2", metavar="CASE")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--steps", type=int, default=30, help="steps of each kind with the thread idle")
    parser.add_argument("--json-out", default=None)
    parser.add_argument("--trace-c", type=float, default=0.0, metavar="MS",
                        help="also record every C call of another thread that took longer than MS (a profiler "
                             "on those threads: it slows their Python; for finding what holds the GIL)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    join_fake(0, 2)

    import moe_reshard as mr

    import nereus.ir as ir
    from nereus.runtime import Runtime

    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    small = torch.randn(64, device=device)

    def device_step():
        x = a
        for _ in range(8):
            x = x @ a
            x = x / 8192.0
        return x

    def host_step():
        x = small
        for _ in range(2000):
            x = x * 1.0001
        return x

    kinds = {"device": device_step, "host": host_step}

    def timed(kind: str) -> float:
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        kinds[kind]()
        torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    for kind in kinds:  # warm-up: cuBLAS handles, kernels
        for _ in range(3):
            timed(kind)
    mem = torch.cuda.get_device_properties(device).total_memory
    module = ir.parse_source(mr.module_source(args.moe, 2, mem, mr.SHAPES["30b-a3b"], args.layers), "ahead.nir")
    trace = _Trace(args.trace_c / 1e3)
    started = trace.t0 = time.perf_counter()
    rt = Runtime(module, "A", device=device)
    busy: dict = {k: [] for k in kinds}
    while not rt.wait_ahead(0):
        for kind in kinds:
            was = not rt.wait_ahead(0)
            at = time.perf_counter()
            seconds = timed(kind)
            trace.step(kind, at, seconds)
            if was and not rt.wait_ahead(0):
                busy[kind].append(seconds)
    busy_s = time.perf_counter() - started
    trace.stop()
    idle = {k: [timed(k) for _ in range(args.steps)] for k in kinds}
    summary = {}
    for kind in kinds:
        row = {"idle_median_ms": statistics.median(idle[kind]) * 1e3, "idle_max_ms": max(idle[kind]) * 1e3,
               "busy_steps": len(busy[kind])}
        if busy[kind]:
            row.update(busy_median_ms=statistics.median(busy[kind]) * 1e3, busy_max_ms=max(busy[kind]) * 1e3)
        summary[kind] = row
        print(f"{kind} step: idle median {row['idle_median_ms']:.2f} ms (max {row['idle_max_ms']:.2f}); "
              + (f"thread busy: median {row['busy_median_ms']:.2f} ms (max {row['busy_max_ms']:.2f}) over "
                 f"{row['busy_steps']} steps" if busy[kind] else "no step while the thread was busy"), flush=True)
    print(f"the thread was busy {busy_s:.2f} s after the Runtime's construction", flush=True)
    for line in trace.worst(5):
        print(line, flush=True)
    rt.close()
    result = {"name": "ahead_interference", "moe": args.moe, "layers": args.layers, "busy_s": busy_s,
              "kinds": summary, "trace": trace.record(), "machine": machine()}
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result))
    return 0


class _Trace:
    """When each training step ran, each step of the thread (which pair, which step) and,
    with `c_min_s`, each C call of another thread longer than that: what a slow training
    step overlapped. Times in seconds from the Runtime's construction."""

    def __init__(self, c_min_s: float):
        import threading

        from nereus.runtime import runtime as runtime_module

        self.t0 = time.perf_counter()
        self.steps, self.thread_steps, self.c_calls = [], [], []
        real = self._real = runtime_module.ahead_steps
        self._module = runtime_module

        def traced(*a):
            generator, index = real(*a), 0
            while True:
                at = time.perf_counter()
                try:
                    value = next(generator)
                except StopIteration:
                    self.thread_steps.append((f"{a[-2]}->{a[-1]}", index, at - self.t0, time.perf_counter() - at))
                    return
                self.thread_steps.append((f"{a[-2]}->{a[-1]}", index, at - self.t0, time.perf_counter() - at))
                index += 1
                yield value

        runtime_module.ahead_steps = traced
        self._threading = threading
        if c_min_s > 0:
            local = threading.local()

            def profile(frame, event, arg):
                if event == "c_call":
                    local.__dict__.setdefault("open", []).append(time.perf_counter())
                elif event in ("c_return", "c_exception") and getattr(local, "open", None):
                    at = local.open.pop()
                    took = time.perf_counter() - at
                    if took >= c_min_s:
                        self.c_calls.append((threading.current_thread().name, getattr(arg, "__qualname__", repr(arg)),
                                             f"{frame.f_code.co_filename.rsplit('/', 2)[-1]}:{frame.f_lineno}",
                                             at - self.t0, took))

            threading.setprofile(profile)

    def step(self, kind: str, at: float, seconds: float) -> None:
        self.steps.append((kind, at - self.t0, seconds))

    def stop(self) -> None:
        self._module.ahead_steps = self._real
        self._threading.setprofile(None)

    def worst(self, n: int) -> list:
        """The n slowest training steps, each with what the thread did meanwhile."""
        lines = []
        for kind, at, took in sorted(self.steps, key=lambda x: -x[2])[:n]:
            end = at + took
            during = [f"{p} step {i} ({t:.3f} s)" for p, i, s, t in self.thread_steps if s < end and s + t > at]
            calls = [f"{name} {fn} at {where} ({t:.3f} s)" for name, fn, where, s, t in self.c_calls
                     if s < end and s + t > at]
            lines.append(f"slow {kind} step at {at:.3f} s: {took * 1e3:.1f} ms; thread: {'; '.join(during) or '-'}"
                         + (f"; long C calls: {'; '.join(calls)}" if calls else ""))
        return lines

    def record(self) -> dict:
        return {"steps": self.steps, "thread_steps": self.thread_steps, "c_calls": self.c_calls}


if __name__ == "__main__":
    raise SystemExit(main())

"""Profiling helpers of the multi-GPU scripts: one call under the PyTorch profiler, written
out as text (rank 0): the busiest ops by self CUDA time and by CPU time, the GPU timeline per
stream (kernels merged into busy intervals), the host time before the first kernel, the
transition's per-round host timings and its rank program's piece counts. No traces are
kept (they are large); the summaries are what the RESULTS cite.
"""

from __future__ import annotations

import json
import os
import time


def timeline(prof, path: str, label: str) -> dict:
    """GPU busy intervals per stream from the profiler's trace, and host lead time."""
    trace = path + ".json"
    prof.export_chrome_trace(trace)
    with open(trace) as f:
        events = json.load(f).get("traceEvents", [])
    os.remove(trace)
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    if not kernels:
        return {}
    start = min(float(e["ts"]) for e in events if "ts" in e and e.get("ph") == "X")
    by_stream: dict = {}
    for e in kernels:
        by_stream.setdefault(e.get("tid"), []).append((float(e["ts"]) - start, float(e["dur"]), e["name"][:40]))
    summary = {"first_kernel_ms": min(k[0] for ks in by_stream.values() for k in ks) / 1e3,
               "last_end_ms": max(k[0] + k[1] for ks in by_stream.values() for k in ks) / 1e3, "streams": {}}
    lines = [f"== {label}: first GPU work at {summary['first_kernel_ms']:.2f} ms, last ends at "
             f"{summary['last_end_ms']:.2f} ms (from the profiled call's start)"]
    for stream, ks in sorted(by_stream.items(), key=lambda kv: str(kv[0])):
        ks.sort()
        names: dict = {}
        for _, d, n in ks:
            names[n] = names.get(n, 0.0) + d
        merged = []
        for t, d, _ in ks:
            if merged and t <= merged[-1][1] + 20:  # gaps under 20 us are one busy interval
                merged[-1][1] = max(merged[-1][1], t + d)
            else:
                merged.append([t, t + d])
        busy = sum(b - a for a, b in merged)
        summary["streams"][str(stream)] = {"kernels": len(ks), "busy_ms": busy / 1e3,
                                           "span_ms": (merged[-1][1] - merged[0][0]) / 1e3}
        lines.append(f"  stream {stream}: {len(ks)} kernels, busy {busy / 1e3:.2f} ms over "
                     f"{(merged[-1][1] - merged[0][0]) / 1e3:.2f} ms, intervals (ms): "
                     + ", ".join(f"{a / 1e3:.2f}-{b / 1e3:.2f}" for a, b in merged[:16])
                     + (" ..." if len(merged) > 16 else ""))
        lines.append("    by kernel (ms): " + ", ".join(f"{n} {v / 1e3:.2f}" for n, v in
                                                       sorted(names.items(), key=lambda kv: -kv[1])[:6]))
    with open(path, "a") as f:
        f.write("\n".join(lines) + "\n")
    return summary


def lowered(rt, source: str, target: str) -> list:
    """This rank's lowered programs source -> target of a Runtime (run or prepared before)."""
    return [prog for key, prog in rt._lowered.items() if key[:2] == (source, target)]


def program_counts(progs: list, chunk_bytes=None) -> list:
    """Per round of these rank programs: messages, pieces (direct or streamed), same-GPU
    copies and keeps, bytes."""
    from nereus.runtime import streams

    chunk = chunk_bytes or streams.CHUNK_BYTES
    rows = []
    for prog in progs:
        for w in prog.rounds:
            both = {m.peer for m in w.sends} & {m.peer for m in w.recvs}

            def split(msgs):  # a piece of several tensors (a v2 range) counts once per tensor
                pieces = [(p, m.peer in both) for m in msgs for p in m.pieces]
                streamed = [p for p, b in pieces if streams.streamed(p, b, chunk)]
                total = sum(p.count for p, _ in pieces)
                return {"messages": len(msgs), "pieces": total, "streamed_pieces": sum(p.count for p in streamed),
                        "direct_pieces": total - sum(p.count for p in streamed),
                        "streamed_bytes": sum(p.total_bytes for p in streamed),
                        "direct_bytes": sum(p.total_bytes for p, _ in pieces) - sum(p.total_bytes for p in streamed),
                        "contiguous_streamed": sum(p.count for p in streamed if p.direct)}

            rows.append({"round": w.index, "send": split(w.sends), "recv": split(w.recvs),
                         "copies": sum(p.count for p in w.copies), "copy_bytes": sum(p.total_bytes for p in w.copies),
                         "keeps": sum(len(a.tensors) for a in w.aliases), "allocs": len(w.allocs),
                         "frees": len(w.frees)})
    return rows


def profile_call(env, fn, path: str, label: str, rt=None, source=None, target=None, progs=None):
    """One call of `fn` under the PyTorch profiler (CPU + CUDA), barrier before, device
    synchronized after. Rank 0 appends to `path`: the wall time, the ops by self CUDA and
    by CPU time, the per-stream GPU timeline, and where `fn` returns a TransitionReport its
    rounds' host timings (and, given rt/source/target or progs, the programs' piece counts).
    Returns fn's result."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if env.cuda else [])
    env.barrier()
    with torch_profile(activities=activities) as prof:
        t0 = time.perf_counter()
        out = fn()
        env.sync()
        wall = time.perf_counter() - t0
    if env.rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "a") as f:
            f.write(f"== {label} (rank 0): profiled call {wall * 1e3:.2f} ms (profiler on)\n")
            rounds = getattr(out, "rounds", None)
            if isinstance(rounds, list) and rounds:
                f.write(f"   report: seconds {out.seconds * 1e3:.2f} ms, rounds (host, ms): " + "; ".join(
                    f"#{r['index']} total {r['seconds'] * 1e3:.2f} local {r['local_s'] * 1e3:.2f} exchange "
                    f"{r['exchange_s'] * 1e3:.2f} unpack {r['unpack_s'] * 1e3:.2f} msgs {r['messages']}"
                    for r in rounds) + "\n")
            if rt is not None:
                progs = lowered(rt, source, target)
            if progs:
                for row in program_counts(progs):
                    f.write(f"   program round: {json.dumps(row)}\n")
            sort = "self_cuda_time_total" if env.cuda else "self_cpu_time_total"
            f.write(f"== {label}, by self device time ==\n")
            f.write(prof.key_averages().table(sort_by=sort, row_limit=20) + "\n")
            f.write(f"== {label}, by CPU time (total) ==\n")
            f.write(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25) + "\n")
        timeline(prof, path, label)
    return out

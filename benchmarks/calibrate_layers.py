"""Measure a latency table of llama-shaped layer stacks on one GPU, for the controller's cost model.

Times three kernels of RL post-training, each over a grid of shapes:
  forward      - one forward pass over b sequences of s tokens (inference, training forward)
  fwdbwd       - forward + backward (training)
  decode       - one decode step: b sequences, one new token each, attending over a KV cache of
                 c tokens (generation), replayed from a CUDA graph as vLLM does
on a stack of `layers` llama layers (RMSNorm, fused qkv with GQA, SDPA attention, o, fused
gate_up, SwiGLU, down). Tensor parallelism is simulated by dividing heads, kv heads and ffn by tp
(the per-GPU share of a Megatron TP layer), leaving the hidden size whole; the TP all-reduce is
not measured here (it is a separate term of the cost model).

Writes rows {kind, shape, layers, hidden, heads, kv_heads, ffn, tp, batch, seq, context,
seconds, reps} as JSON to $OUT (or --out) and prints one JSON summary line last.

    python3 benchmarks/calibrate_layers.py --out nereus/controller/data/h200_layers.json --budget-s 240
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch
import torch.nn.functional as F

SHAPES = {  # name: (hidden, heads, kv_heads, ffn, layers in the timed stack)
    "llama8b": (4096, 32, 8, 14336, 4),
    "llama70b": (8192, 64, 8, 28672, 2),
}
TPS = (1, 2, 4, 8)
PASS_GRID = ((1, 1024), (4, 1024), (2, 2048), (8, 2048), (2, 4096), (1, 8192))  # (batch, seq)
DECODE_GRID = tuple((b, c) for b in (8, 32, 128, 256) for c in (1024, 4096, 8192))


class Layer(torch.nn.Module):
    def __init__(self, hidden, heads, kv_heads, ffn, head_dim):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.norm1 = torch.nn.RMSNorm(hidden)
        self.norm2 = torch.nn.RMSNorm(hidden)
        self.qkv = torch.nn.Linear(hidden, (heads + 2 * kv_heads) * head_dim, bias=False)
        self.o = torch.nn.Linear(heads * head_dim, hidden, bias=False)
        self.gate_up = torch.nn.Linear(hidden, 2 * ffn, bias=False)
        self.down = torch.nn.Linear(ffn, hidden, bias=False)

    def _split(self, x):
        b, s, _ = x.shape
        qkv = self.qkv(self.norm1(x))
        q, k, v = qkv.split([self.heads * self.head_dim, self.kv_heads * self.head_dim,
                             self.kv_heads * self.head_dim], dim=-1)
        q = q.view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        return q, k, v

    def _mlp(self, x):
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self._split(x)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(attn.transpose(1, 2).reshape(b, s, -1))
        return self._mlp(x)

    def decode(self, x, k_cache, v_cache):
        b = x.shape[0]
        q, k, v = self._split(x)
        # the cache holds c tokens and one free slot for the new token (as a paged KV cache
        # writes in place): the step reads the whole cache once, as vLLM's decode kernels do
        k_cache[:, :, -1:] = k
        v_cache[:, :, -1:] = v
        attn = F.scaled_dot_product_attention(q, k_cache, v_cache, enable_gqa=True)
        x = x + self.o(attn.transpose(1, 2).reshape(b, 1, -1))
        return self._mlp(x)


def time_cuda(fn, reps):
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / 1e3)
    samples.sort()
    return samples[len(samples) // 2]


def time_graph(fn, reps, replays=10):
    """Time `fn` captured in a CUDA graph (as vLLM runs decode steps), so that host launch
    overhead, which dominates an eager decode step, is not measured."""
    if not torch.cuda.is_available():
        return time_cpu(fn, reps)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()

    def replay():
        for _ in range(replays):
            graph.replay()

    seconds = time_cuda(replay, reps) / replays
    del graph
    return seconds


def time_cpu(fn, reps):
    fn()
    began = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - began) / reps


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "h200_layers.json"))
    parser.add_argument("--budget-s", type=float, default=240.0)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, to check the script")
    args = parser.parse_args()
    torch.manual_seed(0)
    global SHAPES, PASS_GRID, DECODE_GRID, time_cuda
    if args.smoke:
        SHAPES = {"tiny": (64, 4, 2, 128, 2)}
        PASS_GRID, DECODE_GRID = ((1, 16), (2, 32)), ((2, 16),)
        time_cuda = time_cpu
    dev = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.bfloat16
    began = time.time()
    rows = []
    stopped_early = False

    def out_of_time():
        return time.time() - began > args.budget_s

    for shape, (hidden, heads, kv_heads, ffn, layers) in SHAPES.items():
        head_dim = hidden // heads
        for tp in TPS:
            if out_of_time():
                stopped_early = True
                break
            h_tp, kv_tp, f_tp = heads // tp, max(1, kv_heads // tp), ffn // tp
            stack = torch.nn.ModuleList(Layer(hidden, h_tp, kv_tp, f_tp, head_dim)
                                        for _ in range(layers)).to(dev, dtype)
            base = dict(shape=shape, layers=layers, hidden=hidden, heads=h_tp, kv_heads=kv_tp,
                        ffn=f_tp, head_dim=head_dim, tp=tp)
            for batch, seq in PASS_GRID:
                x = torch.randn(batch, seq, hidden, device=dev, dtype=dtype)

                def fwd():
                    with torch.no_grad():
                        y = x
                        for layer in stack:
                            y = layer(y)

                xg = x.clone().requires_grad_(True)

                def fwdbwd():
                    y = xg
                    for layer in stack:
                        y = layer(y)
                    y.sum().backward()

                rows.append(dict(base, kind="forward", batch=batch, seq=seq, context=seq,
                                 seconds=time_cuda(fwd, args.reps), reps=args.reps))
                rows.append(dict(base, kind="fwdbwd", batch=batch, seq=seq, context=seq,
                                 seconds=time_cuda(fwdbwd, args.reps), reps=args.reps))
                del x, xg
                stack.zero_grad(set_to_none=True)
            for batch, context in DECODE_GRID:
                x = torch.randn(batch, 1, hidden, device=dev, dtype=dtype)
                caches = [(torch.randn(batch, kv_tp, context + 1, head_dim, device=dev, dtype=dtype),
                           torch.randn(batch, kv_tp, context + 1, head_dim, device=dev, dtype=dtype))
                          for _ in range(layers)]

                def dec():
                    with torch.no_grad():
                        y = x
                        for layer, (kc, vc) in zip(stack, caches):
                            y = layer.decode(y, kc, vc)

                rows.append(dict(base, kind="decode", batch=batch, seq=1, context=context,
                                 seconds=time_graph(dec, args.reps), reps=args.reps))
                del caches
            del stack
            torch.cuda.empty_cache()
    table = dict(
        name="calibrate_layers", device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", torch=torch.__version__,
        python=platform.python_version(), dtype="bf16", stopped_early=stopped_early,
        note="median of reps CUDA-event timings after 2 warm-ups; decode: CUDA-graph replays (10 per sample); tp simulated by dividing heads, kv_heads, ffn",
        rows=rows)
    with open(args.out, "w") as handle:
        json.dump(table, handle, indent=1)
    print(json.dumps(dict(name="calibrate_layers", rows=len(rows), device=table["device"],
                          stopped_early=stopped_early, wall_s=round(time.time() - began, 1))))


if __name__ == "__main__":
    main()

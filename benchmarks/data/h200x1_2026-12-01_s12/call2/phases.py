"""Time the cold path's phases on CPU for a host_only MoE module (no runtime)."""
import sys, time, json
sys.path.insert(0, "/work/main/benchmarks/multi_gpu")
import moe_reshard as mr
import nereus.ir as ir
from nereus.passes import compile_transition
from nereus.backends import json_program
from nereus.backends.rank_json import canonical_json, rank_digests, rank_program_json
from nereus.runtime.admission import verify_before_running
from nereus.runtime.program import rank_program
case, layers = sys.argv[1], int(sys.argv[2])
module = ir.parse_source(mr.module_source(case, 2, 141 * 10**9, mr.SHAPES["host"], layers), "x.nir")
import gc; gc.disable()
T = {}
def t(name, f):
    t0 = time.perf_counter(); r = f(); T[name] = T.get(name, 0) + time.perf_counter() - t0; return r
for rep in range(int(sys.argv[3]) if len(sys.argv) > 3 else 1):
    c = t("compile", lambda: compile_transition(module, "A", "B"))
    part = t("part", lambda: rank_program_json(c, 0))
    text = t("canon", lambda: canonical_json(part))
    whole = t("whole_json", lambda: json_program.program_json(c))
    t("verify", lambda: verify_before_running(whole, module))
    t("digests", lambda: rank_digests(whole))
    prog = t("loads", lambda: json.loads(text))
    rp = t("rank_program", lambda: rank_program(prog, 0))
print(" ".join(f"{k} {v*1e3:.0f}" for k, v in T.items()), f"total {sum(T.values())*1e3:.0f} ms")

"""Where the time of host_only.py's first calls goes: wall-clock seconds and call counts
of the runtime's phases (outermost calls on the main thread: no profiler overhead, and a
background compile thread is not counted), per call, for the first six calls (each
direction's cold, second and first warm call).

    python cold_phases.py OUT.json -- HOST_ONLY_ARGS...

Writes OUT.json ([{target, s, phases: {"module:function": [calls, seconds]}}]) and prints
host_only.py's own lines; its JSON summary stays the last line."""
import functools, importlib, json, os, runpy, sys, threading, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
TARGETS = [
    "nereus.runtime.distribute:obtain_rank_part", "nereus.runtime.distribute:_prove",
    "nereus.runtime.distribute:_lower_own_part", "nereus.runtime.admission:verify_before_running",
    "nereus.backends.rank_json:rank_digests", "nereus.backends.rank_json:canonical_json",
    "nereus.runtime.program:rank_program", "nereus.runtime.execution_plan:build_plan",
    "nereus.runtime.executor:execute", "nereus.backends.triton.packer:Packer._plan",
    "nereus.backends.triton.packer:Packer._build", "nereus.backends.triton.tables:upload",
    "nereus.runtime.rounds:run_round", "nereus.runtime.streams:exchange", "nereus.runtime.wires:allocate",
    "nereus.runtime.packing:copy_pairs", "nereus.runtime.control:agree", "nereus.runtime.rounds:agree_first",
    "nereus.runtime.replay:compile_pending", "nereus.runtime.runtime:Runtime._lower",
    "nereus.runtime.runtime:Runtime._transition", "nereus.runtime.prover:Prover.result",
    "nereus.runtime.runtime:Runtime._lower_part", "nereus.runtime.execution_plan:plan_for",
]
acc, depth = {}, {}
main = threading.main_thread()
def wrap(name, f):
    @functools.wraps(f)
    def w(*a, **kw):
        if threading.current_thread() is not main:
            return f(*a, **kw)
        d = depth.get(name, 0); depth[name] = d + 1
        t0 = time.perf_counter()
        try:
            return f(*a, **kw)
        finally:
            depth[name] = d
            if d == 0:
                s = acc.setdefault(name, [0, 0.0]); s[0] += 1; s[1] += time.perf_counter() - t0
    return w
import nereus.runtime.runtime  # noqa: import order
for t in TARGETS:
    mod, attr = t.split(":")
    m = importlib.import_module(mod)
    owner, leaf = m, attr
    if "." in attr:
        cls, leaf = attr.split(".")
        owner = getattr(m, cls)
    setattr(owner, leaf, wrap(t, getattr(owner, leaf)))
    # modules that imported the function by name
    for other in list(sys.modules.values()):
        if other is not None and getattr(other, "__name__", "").startswith("nereus") and "." not in attr:
            if getattr(other, leaf, None) is getattr(m, leaf).__wrapped__:
                setattr(other, leaf, getattr(m, leaf))
if len(sys.argv) < 3 or sys.argv[2] != "--":
    sys.exit(__doc__)
out = sys.argv[1]
marks = []
import host_only  # noqa: E402
from nereus.runtime import Runtime  # noqa: E402
real = Runtime.transition
def transition(self, target, **kw):
    before = {k: list(v) for k, v in acc.items()}
    t0 = time.perf_counter()
    r = real(self, target, **kw)
    marks.append({"target": target, "s": time.perf_counter() - t0,
                  "phases": {k: [v[0] - before.get(k, [0, 0])[0], round(v[1] - before.get(k, [0, 0.0])[1], 4)]
                             for k, v in acc.items() if v != before.get(k)}})
    return r
Runtime.transition = transition
try:
    code = host_only.main(sys.argv[3:])
finally:
    with open(out, "w") as f:
        json.dump(marks[:6], f, indent=1)
sys.exit(code)

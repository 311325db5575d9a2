"""Wall-clock time per function (outermost calls, main thread) in host_only.py's cold
calls: python coldprobe.py OUT.json -- host_only args"""
import functools, importlib, json, os, runpy, sys, threading, time
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks", "multi_gpu"))
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
    "nereus.runtime.runtime:Runtime._transition",
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
out = sys.argv[1]
marks = []
import host_only
orig = host_only.Runtime if hasattr(host_only, "Runtime") else None
from nereus.runtime import Runtime
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
sys.argv = ["host_only.py"] + sys.argv[3:]
try:
    host_only.main()
finally:
    json.dump(marks[:6], open(out, "w"), indent=1)

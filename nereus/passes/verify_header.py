"""verify_header: the header of a JSON program v1 → `Header`, or ProgramError naming the field.

Input: a program dict (docs/program.md) whose format and version are already checked.
Output: a `Header` (tensors, GPU capacities, nodes, resident bytes, before / after units)
in the plain structures the replay (nereus.passes.verify) reads. Invariant: everything the
replay indexes exists and has the right type, so a malformed program is a located
`ProgramError` (`header field 'units.after' (unit actor.training/1): ...`), never a
KeyError. What is checked here needs no plan; `verify_world` compares the header with the
plans when they are given.

Checks: every box has one [lo, hi] pair of integers per tensor dimension with
0 ≤ lo < hi ≤ dim; GPU ids are unique and capacity_bytes ≤ mem_bytes; every GPU a unit,
shard or resident entry names is in `gpus`; a unit's id is `{model_stage}/{replica}`, its
GPUs are distinct, tp·pp of them, each holding a shard; the units of one model-stage agree
on tp, pp and offload, have distinct replicas and GPUs, and the same model-stages move on
both sides (none of them untouched); per unit the boxes of each tensor its model-stage
holds tile the tensor (replicated copies identical, others disjoint); when `nodes` is
given it declares the node of every GPU (without it, as in v1 programs before the field
was added, host memory is unlimited); `memory_model`, when given, names a model of
`nereus.passes.memory_model` (without it: "cpu", the model v1 programs had before it).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from nereus.ir.diagnostics import ProgramError
from nereus.ir.model import DTYPE_BYTES, STAGES
from nereus.ir.ranges import contains, count, member_mask, parse_at, placeholders, range_last

from .memory_model import FIELD as MEMORY_MODEL, KINDS, V1_DEFAULT


@dataclass(frozen=True)
class Header:
    tensors: dict  # name -> (shape, bytes per element)
    capacity: dict  # gpu -> usable bytes
    node_of: dict  # gpu -> node
    host_capacity: dict  # node -> host bytes (only declared nodes)
    resident: dict  # gpu -> bytes of untouched model-stages
    # unit id -> {gpu: {tensor: ((at, (box, ...)), ...)}}: a shard's entries, `at` the
    # members of a v2 family it covers (() for a plain tensor, the only form in v1)
    before: dict
    after: dict
    stage_of: dict  # ("before" | "after", unit id) -> model_stage
    offloaded: frozenset  # ("before" | "after", unit id) of offloaded units
    # tensor -> its v2 family's indices ((lo, hi), ...); () for a plain tensor
    indices: dict = None
    memory_model: str = V1_DEFAULT  # the device memory model the program is proven for (memory_model.py)

    def sizes(self, name: str) -> tuple:
        """The index space of `name`'s members (for member bitsets): each index's hi."""
        return tuple(hi for _, hi in self.indices.get(name, ()))


# the section of docs/program.md that describes what an error is about (a hint for the
# errors that need no more specific one)
_SECTIONS = (("header field 'units", "\"Units and the local shard contract\" gives a unit's fields and how "
              "its shards' boxes tile each tensor"),
             ("header field", "\"Top level\" gives each header field and its type"),
             ("round", "\"Ops\" gives each op's fields and the phase order of a round"),
             ("after round", "\"Ops\" says what each op must leave done by the last round"))


def fail(message: str, hint: str | None = None):
    if hint is None:
        hint = next((f"docs/program.md, {text}; programs `nereusc FILE --emit json` writes verify"
                     for prefix, text in _SECTIONS if message.startswith(prefix)), None)
    raise ProgramError(message, hint=hint)


def shown(value, width: int = 40) -> str:
    """`value` as an error quotes it: its repr, cut to `width` characters (a 4000-digit
    number was echoed whole)."""
    text = repr(value)
    return text if len(text) <= width else f"{text[:width - 12]}... ({len(text)} characters)"


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def nonnegative(value, where: str, what: str) -> int:
    if not is_int(value) or value < 0:
        fail(f"{where}: {what} must be a non-negative integer, not {shown(value)}")
    return value


class BoxError(ProgramError):
    """A malformed box; `path` locates it inside the box (a dimension, or a bound: (d, 0|1)),
    and each caller that knows more of where the box sits prepends it on the way out."""


def check_box(box, shape: tuple, where: str, name: str) -> tuple:
    """`box` as a tuple of (lo, hi) after checking rank, integer bounds and 0 ≤ lo < hi ≤ dim;
    BoxError otherwise."""
    # fast path for the well-formed plain lists of a JSON program (the replay checks
    # hundreds of thousands of boxes); anything else takes the checks below and their messages
    if type(box) is list and len(box) == len(shape):
        out = []
        for pair, n in zip(box, shape):
            if type(pair) is not list or len(pair) != 2:
                break
            lo, hi = pair
            if type(lo) is not int or type(hi) is not int or not 0 <= lo < hi <= n:
                break
            out.append((lo, hi))
        else:
            return tuple(out)
    if not isinstance(box, (list, tuple)) or len(box) != len(shape):
        raise BoxError(f"{where}: box {box!r} of {name} has {len(box) if isinstance(box, (list, tuple)) else 'no'}"
                       f" dimensions, its shape in header field 'tensors' {list(shape)} has {len(shape)}",
                       hint="a box is one [lo, hi] pair per tensor dimension", path=())
    out = []
    for d, (pair, n) in enumerate(zip(box, shape)):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise BoxError(f"{where}: box {box!r} of {name}: dimension {d} is not one [lo, hi] pair",
                           hint="a box is one [lo, hi] pair per tensor dimension", path=(d,))
        for e, bound in enumerate(pair):
            if not is_int(bound):  # true is 1 and 2.0 is 2 in Python: an exact type
                raise BoxError(f"{where}: box {box!r} of {name}: bound {shown(bound)} must be an integer",
                               hint="every dimension needs integers 0 <= lo < hi <= dim (not 2.0, not true)",
                               path=(d, e))
        if not 0 <= pair[0] < pair[1] <= n:
            raise BoxError(f"{where}: box {box!r} of {name} is not inside {list(shape)}",
                           hint="every dimension needs integers 0 <= lo < hi <= dim", path=(d,))
        out.append((pair[0], pair[1]))
    return tuple(out)


def volume(box) -> int:
    n = 1
    for lo, hi in box:
        n *= hi - lo
    return n


def overlap(x, y) -> bool:
    return all(a < d and c < b for (a, b), (c, d) in zip(x, y))


def _field(data: dict, key: str, kind: type):
    value = data.get(key)
    if not isinstance(value, kind):
        fail(f"header field '{key}' must be a {kind.__name__}, not {type(value).__name__}")
    return value


def parse_header(data: dict) -> Header:
    """Check and index the header of `data` (module docstring)."""
    ranged = data.get("version") == 2
    tensors, indices = _tensors(_field(data, "tensors", list), ranged)
    capacity, node_of = _gpus(_field(data, "gpus", list))
    resident = {}
    for key, value in _field(data, "resident_bytes", dict).items():
        where = f"header field 'resident_bytes' (GPU {key})"
        # the GPU's id in decimal, as the emitter writes it: "00" or "٣" would name GPU 0 or 3
        # a second time, the later value silently winning
        gpu = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() and key == str(int(key)) else None
        if gpu not in capacity:
            fail(f"{where}: no such GPU in 'gpus'" if gpu is not None else f"{where}: not a GPU id written in decimal",
                 hint="resident_bytes maps each GPU's id, written as in 'gpus' (\"0\", \"1\", ...), to bytes")
        resident[gpu] = nonnegative(value, where, "resident bytes")
    untouched = data.get("untouched", [])
    if not isinstance(untouched, list) or not all(isinstance(x, str) for x in untouched):
        fail("header field 'untouched' must be a list of model-stage names")
    units = _field(data, "units", dict)
    stage_of, offloaded, parsed = {}, set(), {}
    stages_of_side = {}
    for side in ("before", "after"):
        listed = units.get(side)
        if not isinstance(listed, list):
            fail(f"header field 'units.{side}' must be a list")
        parsed[side] = _units(listed, side, tensors, indices, capacity, stage_of, offloaded)
        stages_of_side[side] = {stage_of[(side, uid)] for uid in parsed[side]}
    if stages_of_side["before"] != stages_of_side["after"]:
        fail(f"header field 'units': model-stages {sorted(stages_of_side['before'] ^ stages_of_side['after'])}"
             " move on one side only", hint="a model-stage that moves has before and after units")
    if stages_of_side["before"] & set(untouched):
        fail(f"header field 'untouched' lists {sorted(stages_of_side['before'] & set(untouched))}, which move")
    host_capacity = _nodes(data, node_of)
    return Header(tensors, capacity, node_of, host_capacity, resident, parsed["before"], parsed["after"],
                  stage_of, frozenset(offloaded), indices, _memory_model(data))


def _memory_model(data: dict) -> str:
    """The header's `memory_model`; a program without it (v1 before the field) was proven
    for the model it had then, "cpu"."""
    kind = data.get(MEMORY_MODEL, V1_DEFAULT)
    if kind not in KINDS:
        fail(f"header field '{MEMORY_MODEL}' must be one of {', '.join(map(repr, KINDS))}, not {shown(kind)}",
             hint="the device memory model the program is proven for (docs/program.md, \"Memory\")")
    return kind


def _tensors(listed: list, ranged: bool) -> tuple[dict, dict]:
    tensors, indices = {}, {}
    weight_dtype: dict[str, str] = {}
    for i, t in enumerate(listed):
        where = f"header field 'tensors' (entry {i})"
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            fail(f"{where}: a tensor needs a name, shape and dtype")
        shape, dtype = t.get("shape"), t.get("dtype")
        if not isinstance(shape, list) or not all(is_int(n) and n > 0 for n in shape):
            fail(f"{where}: shape {shape!r} of {t['name']} must be a list of positive integers")
        if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
            fail(f"{where}: unknown dtype {dtype!r} of {t['name']}", hint=f"one of {sorted(DTYPE_BYTES)}")
        if "#" in t["name"] and dtype != "fp32":
            # an architecture model's optimizer state is fp32; a tensors model keeps the
            # states it declares in its own dtype, the weight's (listed before its states)
            weight = tensors.get(t["name"].split("#", 1)[0])
            if weight is None or DTYPE_BYTES[dtype] != weight[1] or dtype != weight_dtype.get(t["name"].split("#")[0]):
                fail(f"{where}: optimizer state {t['name']} must be fp32 or its weight's dtype, not {dtype}")
        if t["name"] in tensors:
            fail(f"{where}: tensor name {t['name']} listed twice")
        tensors[t["name"]] = (tuple(shape), DTYPE_BYTES[dtype])
        weight_dtype[t["name"]] = dtype
        n = placeholders(t["name"]) if ranged else 0
        if n or ranged and "indices" in t:
            at = parse_at(t.get("indices"), where, "'indices'")
            if len(at) != n or any(r[2] != 1 for r in at):
                fail(f"{where}: family {t['name']} has {n} placeholders and needs as many [lo, hi] 'indices'")
            indices[t["name"]] = tuple((lo, hi) for lo, hi, _ in at)
    return tensors, indices


def shard_at(entry: dict, name: str, indices: dict, where: str) -> tuple:
    """The `at` of a v2 shard or segment of `name`, checked inside the family's indices
    (() for a plain tensor, which takes none)."""
    family = indices.get(name)
    if family is None:
        if "at" in entry:
            fail(f"{where}: {name} is not a family: it takes no 'at'")
        return ()
    if "at" not in entry:
        fail(f"{where}: {name} is a family: its members need 'at' ranges")
    at = parse_at(entry["at"], where)
    if len(at) != len(family) or any(r[0] < lo or range_last(r) >= hi for r, (lo, hi) in zip(at, family)):
        fail(f"{where}: 'at' {entry['at']!r} of {name} lies outside its indices {[list(x) for x in family]}")
    return at


def _gpus(listed: list) -> tuple[dict, dict]:
    capacity, node_of = {}, {}
    for i, g in enumerate(listed):
        where = f"header field 'gpus' (entry {i})"
        if not isinstance(g, dict):
            fail(f"{where}: a GPU is an object with id, node, mem_bytes and capacity_bytes")
        gpu = nonnegative(g.get("id"), where, "id")
        if gpu in capacity:
            fail(f"{where}: GPU id {gpu} listed twice")
        mem = nonnegative(g.get("mem_bytes"), where, "mem_bytes")
        usable = nonnegative(g.get("capacity_bytes", mem), where, "capacity_bytes")
        if usable > mem:
            fail(f"{where}: GPU {gpu} capacity_bytes {usable} exceeds its mem_bytes {mem}",
                 hint="capacity_bytes = mem_bytes × (1 − reserve)")
        capacity[gpu] = usable
        node_of[gpu] = nonnegative(g.get("node"), where, "node")
    return capacity, node_of


def _nodes(data: dict, node_of: dict) -> dict:
    if "nodes" not in data:
        # JSON v1 before `nodes` was added: host memory is not limited. Only the plans
        # (`verify_world`) can tell a program whose `nodes` were dropped.
        return {}
    host = {}
    for i, n in enumerate(_field(data, "nodes", list)):
        where = f"header field 'nodes' (entry {i})"
        if not isinstance(n, dict):
            fail(f"{where}: a node is an object with id and host_mem_bytes")
        node = nonnegative(n.get("id"), where, "id")
        if node in host:
            fail(f"{where}: node id {node} listed twice")
        host[node] = nonnegative(n.get("host_mem_bytes"), where, "host_mem_bytes")
    missing = sorted(set(node_of.values()) - set(host))
    if missing:
        fail(f"header field 'nodes': node {missing[0]} of the GPUs is not declared")
    return host


def _units(listed: list, side: str, tensors: dict, indices: dict, capacity: dict, stage_of: dict,
           offloaded: set) -> dict:
    """{unit id: {gpu: {tensor: boxes}}} of one side, after the checks of the module docstring."""
    out: dict = {}
    shape_of_stage: dict = {}
    gpus_of_stage: dict = defaultdict(set)
    replicas_of_stage: dict = defaultdict(set)
    sharded: dict = defaultdict(lambda: defaultdict(set))  # model-stage -> tensor -> chunk boxes
    dp_of_unit: dict = {}  # unit id -> (model-stage, the dp it states)
    for i, unit in enumerate(listed):
        where = f"header field 'units.{side}' (entry {i})"
        if not isinstance(unit, dict) or not isinstance(unit.get("id"), str):
            fail(f"{where}: a unit is an object with id, model_stage, replica, gpus and shards")
        uid = unit["id"]
        where = f"header field 'units.{side}' (unit {uid})"
        name = unit.get("model_stage")
        model, _, stage = name.partition(".") if isinstance(name, str) else ("", "", "")
        if not model or stage not in STAGES:
            fail(f"{where}: model_stage {name!r} is not MODEL.STAGE", hint=f"stages are {', '.join(STAGES)}")
        replica = nonnegative(unit.get("replica"), where, "replica")
        if uid != f"{name}/{replica}":
            fail(f"{where}: id must be '{name}/{replica}' (its model_stage and replica)")
        if uid in out:
            fail(f"{where}: listed twice")
        if replica in replicas_of_stage[name]:
            fail(f"{where}: replica {replica} of {name} listed twice")
        replicas_of_stage[name].add(replica)
        gpus = unit.get("gpus")
        if not isinstance(gpus, list) or not gpus or len(set(map(str, gpus))) != len(gpus):
            fail(f"{where}: gpus must be a non-empty list of distinct GPU ids")
        for g in gpus:
            if not is_int(g) or g not in capacity:
                fail(f"{where}: GPU {g!r} is not in header field 'gpus'")
            if g in gpus_of_stage[name]:
                fail(f"{where}: GPU {g} already holds another replica of {name}")
        gpus_of_stage[name].update(gpus)
        tp, pp, ep = unit.get("tp", 1), unit.get("pp", len(gpus)), unit.get("ep", 1)
        if not (is_int(tp) and is_int(pp) and is_int(ep) and tp > 0 and pp > 0 and ep > 0
                and tp * pp * ep == len(gpus)):
            fail(f"{where}: tp {tp!r} × pp {pp!r} × ep {ep!r} must equal its {len(gpus)} GPUs")
        offload = unit.get("offload", False)
        if not isinstance(offload, bool):
            fail(f"{where}: offload must be true or false")
        zero = unit.get("zero", 0)
        if zero not in (0, 1, 3) or zero and stage != "training":
            fail(f"{where}: zero {zero!r} must be 0, 1 or 3, and non-zero only on a training unit")
        if shape_of_stage.setdefault(name, (tp, pp, offload, zero, ep)) != (tp, pp, offload, zero, ep):
            fail(f"{where}: tp, pp, ep, offload and zero differ from the other units of {name}")
        if "dp" in unit:  # stated by zero units (docs/program.md): the model-stage's units on this side
            dp_of_unit[uid] = (name, unit["dp"])
        stage_of[(side, uid)] = name
        if offload:
            offloaded.add((side, uid))
        mesh = unit.get("mesh")
        if mesh is not None and not (isinstance(mesh, list) and mesh and all(
                isinstance(d, list) and len(d) == 2 and isinstance(d[0], str) and is_int(d[1]) and d[1] > 0
                for d in mesh)):
            fail(f"{where}: mesh must be a list of [name, size] pairs")
        # a mesh layout may leave a GPU without any shard (a short dimension cut by torch.chunk)
        try:
            out[uid], chunks = _shards(unit.get("shards"), where, model, stage, set(gpus), tensors, indices, zero,
                                       empty_gpus=mesh is not None)
        except BoxError as error:  # the path in the program: now whole
            error.path = ("units", side, i) + error.path
            raise
        for tensor, boxes in chunks.items():
            sharded[name][tensor].update(boxes)
    for uid, (name, dp) in dp_of_unit.items():
        if dp != len(replicas_of_stage[name]):
            fail(f"header field 'units.{side}' (unit {uid}): dp {dp!r} is not the {len(replicas_of_stage[name])} "
                 f"units of {name} listed", hint="a zero unit's dp counts its model-stage's data-parallel replicas")
    for name, boxes_of in sharded.items():
        # under zero the dp units tile the sharded tensors together (each holds a chunk)
        every = shape_of_stage[name][3] >= 3
        model = name.partition(".")[0]
        missing = {n for n in tensors if n.startswith(model + "/") and ("#" in n or every)} - set(boxes_of)
        if missing:
            fail(f"header field 'units.{side}': units of {name} (zero) hold no chunk of {sorted(missing)[:3]}")
        _check_tiling(boxes_of, tensors, indices, f"header field 'units.{side}': units of {name} (zero)")
    return out


def _shards(listed, where: str, model: str, stage: str, gpus: set, tensors: dict, indices: dict, zero: int = 0,
            empty_gpus: bool = False):
    """({gpu: {tensor: ((at, boxes), ...)}}, {tensor: {(at, chunk box)}} of the state `zero`
    shards over dp). `empty_gpus`: a mesh layout's GPU may hold no shard."""
    if not isinstance(listed, list):
        fail(f"{where}: shards must be a list")
    shards: dict = defaultdict(dict)
    for j, shard in enumerate(listed):
        if not isinstance(shard, dict):
            fail(f"{where}: a shard is an object with gpu, tensor and boxes")
        name, g, boxes = shard.get("tensor"), shard.get("gpu"), shard.get("boxes")
        if not isinstance(name, str) or name not in tensors:
            fail(f"{where}: unknown tensor {name!r} (no such name in header field 'tensors')")
        if not is_int(g) or g not in gpus:
            fail(f"{where}: shard of {name} on GPU {g!r}, not one of the unit's GPUs")
        if not isinstance(boxes, list) or not boxes:
            fail(f"{where}: shard of {name} on GPU {g} has no boxes")
        shape = tensors[name][0]
        at = shard_at(shard, name, indices, where)
        parsed = []
        try:
            for b, box in enumerate(boxes):
                parsed.append(check_box(box, shape, where, name))
        except BoxError as error:
            error.path = ("shards", j, "boxes", b) + error.path
            raise
        parsed = tuple(parsed)
        for box in parsed:
            if box[1:] != parsed[0][1:]:
                fail(f"{where}: boxes of {name} on GPU {g} differ beyond dim 0",
                     hint="the local shard contract concatenates boxes along dim 0")
        entries = shards[g].setdefault(name, [])
        if any(not at or member_mask(at, _sizes(indices, name)) & member_mask(other, _sizes(indices, name))
               for other, _ in entries):
            fail(f"{where}: two shards of {name} on GPU {g}")
        entries.append((at, parsed))
    if zero or empty_gpus:  # a GPU's chunks may all be empty (dim 0 shorter than dp): it still takes part
        for g in gpus:
            shards.setdefault(g, {})
    if set(shards) != gpus:
        fail(f"{where}: GPU {sorted(gpus - set(shards))[0]} of the unit holds no shard")
    expected = {n for n in tensors if n.startswith(model + "/") and ("#" not in n or stage == "training" and not zero)
                and not zero >= 3}
    boxes_of: dict = defaultdict(set)
    chunks: dict = defaultdict(set)
    for per_gpu in shards.values():
        for name, entries in per_gpu.items():
            split = zero and ("#" in name or zero >= 3)  # zero 3: the weights too
            (chunks if split else boxes_of)[name].update((at, b) for at, boxes in entries for b in boxes)
    if set(boxes_of) != expected:
        fail(f"{where}: its shards do not cover its tensors (missing {sorted(expected - set(boxes_of))[:3] or 'none'},"
             f" extra {sorted(set(boxes_of) - expected)[:3] or 'none'})")
    _check_tiling(boxes_of, tensors, indices, where)
    return {g: {name: tuple(entries) for name, entries in per.items()} for g, per in shards.items()}, chunks


def _sizes(indices: dict, name: str) -> tuple:
    return tuple(hi for _, hi in indices.get(name, ()))


def _check_tiling(boxes_of: dict, tensors: dict, indices: dict, where: str) -> None:
    """The boxes of each tensor tile it: identical or disjoint, covering every element; of
    a family, every member (its members as bitsets per distinct box: two boxes that
    overlap may not share a member, and the boxes' volumes times their members add up to
    the family's)."""
    for name, held in boxes_of.items():
        sizes = _sizes(indices, name)
        masks: dict = defaultdict(int)
        for at, box in held:
            masks[box] |= member_mask(at, sizes)
        distinct = sorted(masks)
        for i, x in enumerate(distinct):
            for y in distinct[i + 1:]:
                if x and y[0][0] >= x[0][1]:  # sorted by dim-0 start: no later box meets x in dim 0
                    break
                if overlap(x, y) and masks[x] & masks[y]:
                    fail(f"{where}: boxes {x} and {y} of {name} overlap without being identical")
        members = count(tuple((lo, hi, 1) for lo, hi in indices.get(name, ())))
        if sum(bin(masks[b]).count("1") * volume(b) for b in distinct) != \
                members * volume(tuple((0, n) for n in tensors[name][0])):
            fail(f"{where}: the boxes of {name} do not cover the tensor (shape {list(tensors[name][0])})")


def holds(entries, at: tuple, box: tuple) -> bool:
    """Whether shard `entries` ((at, boxes), ...) hold `box` of every member of `at`: one
    entry covering them all, or else member by member."""
    for eat, boxes in entries:
        if contains(eat, at) and any(_inside(box, b) for b in boxes):
            return True
    if not at:
        return False
    from nereus.ir.ranges import members

    for idx in members(at):
        point = tuple((i, i + 1, 1) for i in idx)
        if not any(contains(eat, point) and any(_inside(box, b) for b in boxes) for eat, boxes in entries):
            return False
    return True


def _inside(inner, outer) -> bool:
    return all(a >= c and b <= d for (a, b), (c, d) in zip(inner, outer))


def entries_volume(entries) -> int:
    """Elements of a shard given as entries ((at, boxes), ...)."""
    return sum(count(at) * sum(volume(b) for b in boxes) for at, boxes in entries)

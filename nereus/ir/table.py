"""Syntax → the `tensors` model and the mesh layouts that place it (docs/ir.md, "Models
given as tensor tables" and "Mesh layouts").

    model policy = tensors {
      dtype bf16
      states: exp_avg, exp_avg_sq
      tensor "model.embed_tokens.weight"               [32000, 4096]
      tensor "model.layers.{0..31}.self_attn.q_proj.weight" [4096, 4096]
    }
    plan fsdp2_tp2 {
      policy.training  mesh (dp 2, tp 2)  on 0..3 {
        "*.q_proj.weight"  strided(0, 2)  shard(0)
        "*"                shard(0)       replicate
      }
    }

`build_table_model` reads the first block: `{a..b}` in a tensor name expands to one tensor
per integer (several groups expand as nested loops, the first outermost), the table is
kept in canonical (natural name) order so that printing may group tensors again, and each
name is declared once. `build_mesh_layout` reads a placement's `mesh (...)` and rules.
The cross-checks that need the whole module (every tensor matched by a rule, placements
that fit the tensors' dimensions) are validate.py's.
"""

from __future__ import annotations

import re
from typing import Optional

from . import units
from .diagnostics import SemanticError, did_you_mean
from .gpuset import resolve_gpu_set
from .model import (
    DIM_PLACEMENTS, DTYPE_BYTES, TABLE_ARCHITECTURE, Cluster, DimPlacement, LayoutRule, Location, Mesh, MeshLayout,
    Model, TensorDecl,
)
from .syntax import Declaration, RuleSyntax, Word

TABLE_KEYS: tuple[str, ...] = ("dtype", "states:", "tensor")
MAX_TENSORS = 1 << 20  # a table expanded from brace ranges stays within memory
MAX_DIMS = 8
_RANGE = re.compile(r"\{(-?[0-9]+)\.\.(-?[0-9]+)\}")
_DIGITS = re.compile(r"([0-9]+)")


def natural_key(name: str) -> tuple:
    """Sort key ordering `layers.2` before `layers.10`: text and whole numbers alternate."""
    return tuple(int(part) if i % 2 else part for i, part in enumerate(_DIGITS.split(name)))


def expand_name(text: str) -> list[str]:
    """`a.{0..2}.b` → [a.0.b, a.1.b, a.2.b]; several groups nest, the first outermost."""
    match = _RANGE.search(text)
    if match is None:
        return [text]
    lo, hi = int(match.group(1)), int(match.group(2))
    step = 1 if hi >= lo else -1
    head, tail = text[:match.start()], text[match.end():]
    return [head + str(i) + rest for i in range(lo, hi + step, step) for rest in expand_name(tail)]


def _where(decl: Declaration) -> str:
    return f"model '{decl.name.text}'"


def build_table_model(decl: Declaration, where: str) -> Model:
    """A `model NAME = tensors { ... }` declaration → its Model (architecture `tensors`,
    the sizes of the families 0)."""
    if decl.body is None:
        raise SemanticError(f"{where} needs its tensors", decl.base.loc,
                            'write it like tensors { dtype bf16  tensor "weight" [1024, 1024] }', width=decl.base.width)
    dtype, dtype_loc = "bf16", None
    states: tuple[str, ...] = ()
    seen_keys: dict[str, Word] = {}
    tensors: dict[str, TensorDecl] = {}
    for entry in decl.body:
        key = entry.key
        shown = key.text + ":" if entry.kind == "list" else key.text
        if shown not in TABLE_KEYS:
            raise SemanticError(f"unknown key '{shown}' in {where}", key.loc,
                                did_you_mean(shown, TABLE_KEYS) + "a tensors model takes dtype, states: and "
                                'tensor "name" [dims]', width=key.width)
        if shown != "tensor":
            if shown in seen_keys:
                raise SemanticError(f"'{key.text}' is given twice in {where}", key.loc,
                                    f"the first is at {seen_keys[shown].loc.line}:{seen_keys[shown].loc.column}; "
                                    "keep one", width=key.width)
            seen_keys[shown] = key
        if shown == "dtype":
            if entry.kind != "value" or entry.value.text not in DTYPE_BYTES:
                at = entry.value if entry.kind == "value" else key
                raise SemanticError(f"dtype must be {', '.join(DTYPE_BYTES)}", at.loc, "write it like dtype bf16",
                                    width=at.width)
            dtype, dtype_loc = entry.value.text, entry.value.loc
        elif shown == "states:":
            names = tuple(w.text for w in entry.names)
            for w in entry.names:
                if names.count(w.text) > 1:
                    raise SemanticError(f"state '{w.text}' is listed twice", w.loc, "list each state once",
                                        width=w.width)
            states = names
        else:
            if entry.kind != "tensor":
                raise SemanticError("'tensor' takes a quoted name and a shape", key.loc,
                                    'write it like tensor "model.norm.weight" [4096]', width=key.width)
            for tensor in _tensor_decls(entry, where):
                first = tensors.get(tensor.name)
                if first is not None:
                    raise SemanticError(f"tensor '{tensor.name}' is declared twice in {where}", entry.value.loc,
                                        f"the first is at {first.loc.line}:{first.loc.column}; keep one",
                                        width=entry.value.width)
                tensors[tensor.name] = tensor
                if len(tensors) > MAX_TENSORS:
                    raise SemanticError(f"{where} declares more than {MAX_TENSORS} tensors", entry.value.loc,
                                        "a brace range like {0..31} expands to one tensor per number",
                                        width=entry.value.width)
    if not tensors:
        raise SemanticError(f"{where} declares no tensor", decl.name.loc,
                            'add one, e.g. tensor "weight" [1024, 1024]', width=decl.name.width)
    ordered = tuple(sorted(tensors.values(), key=lambda t: natural_key(t.name)))
    locs = tuple((k, v) for k, v in (("dtype", dtype_loc),) if v is not None)
    return Model(name=decl.name.text, architecture=TABLE_ARCHITECTURE, layers=0, hidden=0, heads=0, kv_heads=0,
                 ffn=0, vocab=0, dtype=dtype, tensors=ordered, states=states, loc=decl.name.loc, key_locs=locs)


def _tensor_decls(entry, where: str) -> list[TensorDecl]:
    word = entry.value
    text = word.text[1:-1]
    if not text:
        raise SemanticError("a tensor needs a name", word.loc, 'write it like tensor "model.norm.weight" [4096]',
                            width=word.width)
    for bad, why in (("#", "'#' separates a tensor from its optimizer states"), ("/", "'/' separates the model "
                     "from the tensor in global names"), (" ", "a name has no spaces"), ("\t", "a name has no tabs")):
        if bad in text:
            raise SemanticError(f"tensor name '{text}' contains {bad!r}", word.loc, why, width=word.width)
    shape = []
    for dim in entry.names:
        try:
            shape.append(units.parse_int(dim.text, "a tensor dimension"))
        except units.UnitError as error:
            raise SemanticError(error.message, dim.loc, error.hint, width=dim.width) from None
    if len(shape) > MAX_DIMS:
        raise SemanticError(f"tensor '{text}' has {len(shape)} dimensions", word.loc,
                            f"at most {MAX_DIMS} are supported", width=word.width)
    names = expand_name(text)
    if any("{" in n or "}" in n for n in names):
        raise SemanticError(f"tensor name '{text}' has a brace that is no range", word.loc,
                            "braces write a range of whole numbers, like {0..31}", width=word.width)
    if len(names) > MAX_TENSORS:
        raise SemanticError(f"'{text}' expands to {len(names)} tensors, more than {MAX_TENSORS}", word.loc,
                            width=word.width)
    return [TensorDecl(name, tuple(shape), loc=word.loc) for name in names]


def _mesh_dims(words, what: str) -> tuple[tuple[str, int], ...]:
    dims = []
    seen: dict[str, Word] = {}
    for name, size in words:
        if name.text in seen:
            raise SemanticError(f"mesh dimension '{name.text}' is named twice in {what}", name.loc,
                                "give every dimension its own name, e.g. mesh (dp 2, tp 4)", width=name.width)
        seen[name.text] = name
        try:
            value = units.parse_int(size.text, f"mesh dimension {name.text}")
        except units.UnitError as error:
            raise SemanticError(error.message, size.loc, error.hint, width=size.width) from None
        dims.append((name.text, value))
    return tuple(dims)


def _dim_placement(name: Word, args: tuple[Word, ...]) -> DimPlacement:
    kind = name.text
    if kind not in DIM_PLACEMENTS:
        raise SemanticError(f"unknown placement '{kind}'", name.loc,
                            did_you_mean(kind, DIM_PLACEMENTS) + "a mesh dimension takes replicate, shard(DIM) or "
                            "strided(DIM, SPLIT)", width=name.width)
    wanted = {"replicate": 0, "shard": 1, "strided": 2}[kind]
    if len(args) != wanted:
        form = {"replicate": "replicate", "shard": "shard(0)", "strided": "strided(0, 2)"}[kind]
        raise SemanticError(f"'{kind}' takes {wanted} argument{'s' if wanted != 1 else ''}, found {len(args)}",
                            name.loc, f"write it like {form}", width=name.width)
    values = []
    for i, word in enumerate(args):
        try:
            values.append(units.parse_int(word.text, "a tensor dimension" if i == 0 else "a split factor",
                                          minimum=0 if i == 0 else 1))
        except units.UnitError as error:
            raise SemanticError(error.message, word.loc, error.hint, width=word.width) from None
    return DimPlacement(kind, *values, loc=name.loc)


def build_mesh_layout(mesh_word: Word, dims_words, layout: Optional[tuple[RuleSyntax, ...]],
                      layout_word: Optional[Word], cluster: Cluster, where: str) -> MeshLayout:
    """A placement's `mesh (d n, ...)` and its `{ rules }` → MeshLayout (the mesh's GPUs
    are the placement's `on` set, checked against its size by validation)."""
    dims = _mesh_dims(dims_words, where)
    if layout is None:
        raise SemanticError(f"{where} has a mesh but no layout rules", mesh_word.loc,
                            'add them after the GPU set, e.g. { "*" shard(0) replicate }', width=4)
    rules = []
    for rule in layout:
        pattern = rule.pattern.text[1:-1]
        if not pattern:
            raise SemanticError("an empty pattern matches no tensor", rule.pattern.loc,
                                'write "*" to match every tensor', width=rule.pattern.width)
        mesh = None
        if rule.mesh is not None:
            words, items, word = rule.mesh
            rule_dims = _mesh_dims(words, f"the rule {rule.pattern.text}")
            gpus = resolve_gpu_set(items, cluster, rule.pattern.text)
            mesh = Mesh(rule_dims, gpus, items, loc=word.loc)
        placements = tuple(_dim_placement(name, args) for name, args in rule.placements)
        rules.append(LayoutRule(pattern, placements, mesh, loc=rule.pattern.loc))
    loc: Location = layout_word.loc if layout_word is not None else mesh_word.loc
    return MeshLayout(dims, tuple(rules), loc=loc)

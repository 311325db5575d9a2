"""`.nir` text → syntax tree (declarations of generic `key value` entries with locations).

One module-level LALR parser built from grammar.lark. Lark's errors are rewritten into
words a user knows ("expected a GPU set, found 'foo'", "unexpected end of input; expected
'}'"), never internal token names. Meaning (which keys exist, what values they take) is
checked later, in build.py.
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass, replace
from typing import Optional, Union

from lark import Lark, Token, Tree
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from .diagnostics import ParseError, source_lines
from .model import GpuSetItem, Location

_GRAMMAR = os.path.join(os.path.dirname(__file__), "grammar.lark")
with open(_GRAMMAR, encoding="utf-8") as _file:
    _PARSER = Lark(_file.read(), parser="lalr", propagate_positions=True, maybe_placeholders=False)


@dataclass(frozen=True)
class Word:
    """A token as written, with where it starts."""

    text: str
    loc: Location

    @property
    def width(self) -> int:
        return len(self.text)


@dataclass(frozen=True)
class Entry:
    """One entry of a `{ ... }` block: `key value` (kind "value"), `key { ... }` ("block"),
    `key: a, b` ("list") or `key "name" [d0, d1]` ("tensor": `value` is the quoted name as
    written, `names` the dimensions)."""

    key: Word
    kind: str
    value: Optional[Word] = None
    block: tuple["Entry", ...] = ()
    names: tuple[Word, ...] = ()


@dataclass(frozen=True)
class RuleSyntax:
    """`"pattern" [mesh (d n, ...) on GPUS] p0 p1 ...` of a mesh layout: the quoted
    pattern, the rule's own mesh (its (name, size) words and GPU set items) or None, and
    each placement as (name, argument words)."""

    pattern: Word
    mesh: Optional[tuple[tuple[tuple[Word, Word], ...], tuple[GpuSetItem, ...], Word]]
    placements: tuple[tuple[Word, tuple[Word, ...]], ...]


@dataclass(frozen=True)
class PlacementSyntax:
    """`actor.training dp 8 tp 4 on 0..31 offload`: the model-stage and its items in order;
    an item is ("key", key, value), ("flag", word, None), ("on", word, set items) or
    ("mesh", word, ((name, size), ...) words). `layout` holds the rules of a mesh layout's
    `{ ... }` (None when it has none), `layout_word` its opening brace."""

    model_stage: Word
    items: tuple[tuple[str, Word, Union[Word, tuple, None]], ...]
    layout: Optional[tuple[RuleSyntax, ...]] = None
    layout_word: Optional[Word] = None


@dataclass(frozen=True)
class Declaration:
    """A top-level declaration. kind: cluster, model, workload, plan, transition.
    `base` is the word after `=` (model alias / architecture, plan base) or the target of a
    transition; `body` is None for a model alias written without braces. A model written
    `= hf("path")` has `base` hf and `argument` the quoted string as written, quotes included."""

    kind: str
    keyword: Word
    name: Word
    base: Optional[Word] = None
    body: Optional[tuple[Entry, ...]] = None
    placements: tuple[PlacementSyntax, ...] = ()
    end_line: int = 0  # the line of the declaration's last token (its closing brace)
    argument: Optional[Word] = None


_WORDS = {
    "NAME": "a name",
    "QUANTITY": "a number",
    "MODEL_STAGE": "a model-stage like actor.training",
    "GPU_ID": "a GPU id",
    "NODE": "a node like n2",
    "STRING": "a quoted string",
    "$END": "end of input",
}
_DECLARATION_KEYWORDS = {"CLUSTER", "MODEL", "WORKLOAD", "PLAN", "TRANSITION"}


def _terminal_words() -> dict[str, str]:
    words = dict(_WORDS)
    for terminal in _PARSER.terminals:
        if terminal.name not in words and terminal.pattern.type == "str":
            words[terminal.name] = f"'{terminal.pattern.value}'"
    return words


_TERMINAL_WORDS = _terminal_words()


def _describe_expected(expected: set[str]) -> str:
    expected = {name for name in expected if name not in ("WS", "COMMENT")}
    if {"GPU_ID", "NODE"} <= expected:
        return "a GPU set (like 0..7, n1 or n2:0..3)"
    if _DECLARATION_KEYWORDS & expected:
        return "a declaration (cluster, model, workload, plan or transition)"
    if {"NAME", "ON", "MODEL_STAGE", "RBRACE"} <= expected:
        return "a placement key (dp, tp, pp, ep, on, offload, zero, mesh, quant), the next model-stage or '}'"
    if {"STRING", "RBRACE"} <= expected and "NAME" not in expected:
        return "a layout rule like \"*.weight\" shard(0) or '}'"
    if {"MODEL_STAGE", "RBRACE"} <= expected:
        return "a model-stage like actor.training or '}'"
    if {"QUANTITY", "NAME", "LBRACE", "COLON"} <= expected:
        return "a value, '{' or ':'"
    if {"NAME", "RBRACE"} <= expected and len(expected) == 2:
        return "a key or '}'"
    words = sorted(_TERMINAL_WORDS.get(name, name.lower()) for name in expected)
    if len(words) == 1:
        return words[0]
    return ", ".join(words[:-1]) + " or " + words[-1]


# the form to write, by what the parser expected (terminal names): the hint of a syntax
# error that has no more precise one
_FORMS = (
    ({"GPU_ID", "NODE"}, "GPU sets are written like on 0..7, on 0, 2, 4, on n0..n1 or on n1:0..3"),
    ({"->"}, "a transition is written: transition S1 -> S2"),
    ({"MODEL_STAGE"}, "a placement is written: actor.training dp 2 tp 4 on 0..7"),
    ({"EQUAL"}, "declarations are written: model actor = llama { ... }, plan A { ... }, plan B = A { ... }"),
    ({"LBRACE"}, "a block follows in braces: cluster c { ... }, plan A { ... }"),
    ({"RBRACE"}, "a block holds keys with their values (microbatch 4), blocks, and ends with '}'"),
    ({"QUANTITY"}, "a key takes a value, like layers 32, mem 141GB or intra 900GB/s"),
    ({"NAME"}, "names start with a letter or '_': actor, plan_b, S1"),
)


def _form_hint(expected: set[str]) -> str:
    # terminal names, and the anonymous ones ('->', '..') by what they match
    named = {_TERMINAL_WORDS.get(name, name).strip("'") for name in expected} | set(expected)
    for names, hint in _FORMS:
        if names & named:
            return hint
    return "the .nir syntax: docs/ir.md"


def _braces(text: str, upto: int):
    """(offset, "{" | "}") of the braces of text[:upto], those in comments and quoted
    strings left out."""
    state = None  # None, "#" (in a comment) or '"' (in a string)
    for offset, char in enumerate(text[:upto]):
        if state is not None:
            if char == "\n" or (state == '"' and char == '"'):
                state = None
        elif char in '#"':
            state = char
        elif char in "{}":
            yield offset, char


def _innermost_open_brace(text: str, upto: int) -> Optional[int]:
    """The offset of the innermost `{` still open at offset `upto`, if any."""
    stack: list[int] = []
    for offset, char in _braces(text, upto):
        if char == "{":
            stack.append(offset)
        elif stack:
            stack.pop()
    return stack[-1] if stack else None


def _location_of(text: str, offset: int, file: str) -> Location:
    return Location(file, text.count("\n", 0, offset) + 1, offset - (text.rfind("\n", 0, offset) + 1) + 1)


def _unclosed_brace_hint(text: str, brace: Optional[int], file: str) -> Optional[str]:
    if brace is None:
        return None
    loc = _location_of(text, brace, file)
    return f"the '{{' at {loc.line}:{loc.column} is not closed"


_UNIT_NAMES = ("KiB", "MiB", "GiB", "TiB", "KB", "MB", "GB", "TB", "B", "GFLOPS", "TFLOPS", "PFLOPS", "FLOPS", "%")
_SPACED_UNIT = re.compile(r"[0-9][ \t]+(?:" + "|".join(re.escape(u) for u in _UNIT_NAMES) + r")(?:/s)?(?![A-Za-z0-9_])")


def _spaced_unit(text: str, line: int, file: str) -> Optional[ParseError]:
    """`host_mem 1 TB` reads as a key `TB`: if the error's line or the one before holds a
    number and a unit apart, that is the mistake to report."""
    lines = source_lines(text)
    for number in (line - 1, line):
        if 1 <= number <= len(lines):
            match = _SPACED_UNIT.search(lines[number - 1])
            if match:
                unit = match.group(0)[1:].strip()
                column = match.start() + len(match.group(0)) - len(unit) + 1
                return ParseError("a unit must follow its number without a space", Location(file, number, column),
                                  f"write {match.group(0)[0]}{unit}, not {match.group(0)[0]} {unit}", text, len(unit))
    return None


_DECLARATION_START = re.compile(r"^[ \t]*(cluster|model|workload|plan|transition)[ \t]", re.MULTILINE)


def _offset(text: str, line: int, column: int) -> int:
    start = 0
    for _ in range(line - 1):
        start = text.index("\n", start) + 1
    return start + column - 1


def _unclosed_before_declaration(text: str, offset: int, file: str) -> Optional[ParseError]:
    """A block left open runs into the next declaration, whose keyword then reads as a
    key: report the missing `}` at that keyword."""
    brace = _innermost_open_brace(text, offset)
    if brace is None:
        return None
    match = _DECLARATION_START.search(text, brace, offset + len("transition "))
    if match is None or match.start(1) > offset:  # a keyword at the error token itself counts
        return None
    return ParseError(f"expected '}}' before '{match.group(1)}'", _location_of(text, match.start(1), file),
                      _unclosed_brace_hint(text, brace, file), text, len(match.group(1)))


def _previous_words_hint(text: str, offset: int) -> Optional[str]:
    words = re.findall(r"[^\s#]+", re.sub(r"#[^\n]*", "", text[:offset]))[-2:]
    if len(words) == 2 and all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", word) for word in words):
        return f"'{words[0]}' took '{words[1]}' as its value; is the value of '{words[0]}' missing?"
    return None


def _syntax_error(error: UnexpectedInput, text: str, file: str) -> ParseError:
    spaced = _spaced_unit(text, getattr(error, "line", 0) or 0, file)
    if spaced is not None:
        return spaced
    if isinstance(error, UnexpectedToken) and error.token.type != "$END":
        token = error.token
        offset = _offset(text, token.line, token.column)
        unclosed = _unclosed_before_declaration(text, offset, file)
        if unclosed is not None:
            return unclosed
        expected = set(error.expected)
        message = f"expected {_describe_expected(expected)}, found '{token}'"
        hint = None
        if token.type == "QUANTITY" and str(token).startswith("-") and {"GPU_ID", "NODE"} & expected:
            hint = "GPU ids are 0 or more"
        elif token.type == "QUANTITY" and "RBRACE" in expected:
            hint = _previous_words_hint(text, offset)
        elif token.type == "QUANTITY" and text[:offset].rstrip().endswith(":"):
            hint = "a value follows its key without ':', like batch 8 (a ':' lists models: training: actor, critic)"
        elif token.type == "NAME":
            keywords = [_TERMINAL_WORDS[name].strip("'") for name in expected if name in _TERMINAL_WORDS]
            close = difflib.get_close_matches(str(token), [k for k in keywords if k.isalpha()], n=1, cutoff=0.6)
            hint = f"did you mean '{close[0]}'?" if close else None
        return ParseError(message, Location(file, token.line, token.column), hint or _form_hint(expected), text,
                          len(str(token)))
    if isinstance(error, (UnexpectedToken, UnexpectedEOF)):
        expected = set(error.expected)
        token = getattr(error, "token", None)
        if token is not None and token.end_line is not None:
            loc = Location(file, token.end_line, token.end_column)
        else:
            lines = source_lines(text) or [""]
            loc = Location(file, len(lines), len(lines[-1]) + 1)
        hint = _unclosed_brace_hint(text, _innermost_open_brace(text, len(text)), file) if "RBRACE" in expected \
            else None
        return ParseError(f"unexpected end of input; expected {_describe_expected(expected)}", loc,
                          hint or _form_hint(expected), text)
    if isinstance(error, UnexpectedCharacters):
        char = text[error.pos_in_stream] if error.pos_in_stream < len(text) else ""
        message = f"unexpected character '{char}'"
        if error.allowed:
            message += f"; expected {_describe_expected(set(error.allowed))}"
        hint = "comments start with '#'" if char in "/;" else _form_hint(set(error.allowed or ()))
        return ParseError(message, Location(file, error.line, error.column), hint, text)
    return ParseError(str(error).splitlines()[0], None, None, text)


def _word(token: Token, file: str) -> Word:
    return Word(str(token), Location(file, token.line, token.column))


_LONE_CR = re.compile(r"\r(?!\n)")
# deeper blocks are never .nir (a declaration's block holds at most one level of blocks:
# gpu { }, rope_scaling { }); the limit keeps the parser's recursion within Python's
MAX_NESTING = 100


def _too_deep(text: str, file: str) -> Optional[ParseError]:
    """The error for the first `{` past MAX_NESTING levels (comments and strings skipped), if any."""
    depth = 0
    for offset, char in _braces(text, len(text)):
        depth = depth + 1 if char == "{" else max(depth - 1, 0)
        if depth > MAX_NESTING:
            return ParseError(f"blocks nest more than {MAX_NESTING} deep", _location_of(text, offset, file),
                              "a declaration's block holds at most one level of blocks "
                              "(gpu { ... }, rope_scaling { ... })", text)
    return None


def parse_syntax(text: str, file: str = "<input>") -> tuple[Declaration, ...]:
    """Input: source text. Output: its declarations in order. Raises ParseError (with the
    source attached) when the text does not follow the grammar."""
    # a lone CR ends a line (old Mac files), as str.splitlines, which error displays and
    # comment anchoring use, has it; CRLF is the grammar's already
    text = _LONE_CR.sub("\n", text)
    deep = _too_deep(text, file) if text.count("{") > MAX_NESTING else None
    if deep is not None:
        raise deep
    try:
        tree = _PARSER.parse(text)
    except UnexpectedInput as error:
        raise _syntax_error(error, text, file) from None
    return tuple(_declaration(node, file) for node in tree.children)


def _declaration(node: Tree, file: str) -> Declaration:
    declaration = _declaration_of(node, file)
    return replace(declaration, end_line=node.meta.end_line)


def _declaration_of(node: Tree, file: str) -> Declaration:
    kind = node.data
    children = node.children
    keyword = Word(kind, Location(file, node.meta.line, node.meta.column))
    name = _word(children[0], file)
    if kind in ("cluster", "workload"):
        return Declaration(kind, keyword, name, body=_block(children[1], file))
    if kind == "model":
        body = _block(children[2], file) if len(children) > 2 else None
        base = children[1]
        if isinstance(base, Tree):  # `hf("path")`
            return Declaration(kind, keyword, name, _word(base.children[0], file), body,
                               argument=_word(base.children[1], file))
        return Declaration(kind, keyword, name, _word(base, file), body)
    if kind == "plan":
        base_node = children[1]
        base = _word(base_node.children[0], file) if base_node.children else None
        placements = tuple(_placement(child, file) for child in children[2:])
        return Declaration(kind, keyword, name, base, placements=placements)
    if kind == "transition":
        return Declaration(kind, keyword, name, _word(children[1], file))
    raise AssertionError(f"grammar produced unknown declaration {kind}")


def _block(node: Tree, file: str) -> tuple[Entry, ...]:
    entries = []
    for child in node.children:
        key = _word(child.children[0], file)
        if child.data == "kv":
            entries.append(Entry(key, "value", value=_word(child.children[1], file)))
        elif child.data == "tensor_decl":
            entries.append(Entry(key, "tensor", value=_word(child.children[1], file),
                                 names=tuple(_word(t, file) for t in child.children[2:])))
        elif child.data == "sub":
            entries.append(Entry(key, "block", block=_block(child.children[1], file)))
        else:
            entries.append(Entry(key, "list", names=tuple(_word(t, file) for t in child.children[1:])))
    return tuple(entries)


def _placement(node: Tree, file: str) -> PlacementSyntax:
    items = []
    layout = None
    layout_word = None
    for child in node.children[1:]:
        if child.data == "pkey":
            items.append(("key", _word(child.children[0], file), _word(child.children[1], file)))
        elif child.data == "pflag":
            items.append(("flag", _word(child.children[0], file), None))
        elif child.data == "pquant":  # `quant fp8`: the keyword is an anonymous token, so its place is the node's
            quant = Word("quant", Location(file, child.meta.line, child.meta.column))
            items.append(("key", quant, _word(child.children[0], file)))
        elif child.data == "pmesh":
            mesh = Word("mesh", Location(file, child.meta.line, child.meta.column))
            items.append(("mesh", mesh, _mesh_dims(child.children[0], file)))
        elif child.data == "layout":
            layout_word = Word("{", Location(file, child.meta.line, child.meta.column))
            layout = tuple(_rule(rule, file) for rule in child.children)
        else:
            on = Word("on", Location(file, child.meta.line, child.meta.column))
            items.append(("on", on, tuple(_gpu_item(item, file) for item in child.children[0].children)))
    return PlacementSyntax(_word(node.children[0], file), tuple(items), layout, layout_word)


def _mesh_dims(node: Tree, file: str) -> tuple[tuple[Word, Word], ...]:
    words = [_word(t, file) for t in node.children]
    return tuple(zip(words[0::2], words[1::2]))


def _rule(node: Tree, file: str) -> RuleSyntax:
    children = node.children
    mesh = None
    rest = children[1:]
    if rest and isinstance(rest[0], Tree) and rest[0].data == "rule_mesh":
        dims_node, set_node = rest[0].children
        word = Word("mesh", Location(file, rest[0].meta.line, rest[0].meta.column))
        mesh = (_mesh_dims(dims_node, file), tuple(_gpu_item(item, file) for item in set_node.children), word)
        rest = rest[1:]
    placements = tuple((_word(p.children[0], file), tuple(_word(t, file) for t in p.children[1:])) for p in rest)
    return RuleSyntax(_word(children[0], file), mesh, placements)


def _gpu_item(node: Tree, file: str) -> GpuSetItem:
    tokens = node.children
    loc = Location(file, tokens[0].line, tokens[0].column)
    numbers = [int(str(t).lstrip("n")) for t in tokens]
    kind = node.data
    if kind == "gpu_id":
        return GpuSetItem("id", numbers[0], numbers[0], loc=loc)
    if kind == "gpu_range":
        return GpuSetItem("range", numbers[0], numbers[1], loc=loc)
    if kind == "node":
        return GpuSetItem("nodes", numbers[0], numbers[0], loc=loc)
    if kind == "node_range":
        return GpuSetItem("nodes", numbers[0], numbers[1], loc=loc)
    if kind == "node_gpu":
        return GpuSetItem("node_gpus", numbers[1], numbers[1], numbers[0], loc=loc)
    return GpuSetItem("node_gpus", numbers[1], numbers[2], numbers[0], loc=loc)

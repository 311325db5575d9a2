"""`.nir` text → syntax tree (declarations of generic `key value` entries with locations).

One module-level LALR parser built from grammar.lark. Lark's errors are rewritten into
words a user knows ("expected a GPU set, found 'foo'", "unexpected end of input; expected
'}'"), never internal token names. Meaning (which keys exist, what values they take) is
checked later, in build.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Union

from lark import Lark, Token, Tree
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from .diagnostics import ParseError
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
    """One entry of a `{ ... }` block: `key value` (kind "value"), `key { ... }` ("block")
    or `key: a, b` ("list")."""

    key: Word
    kind: str
    value: Optional[Word] = None
    block: tuple["Entry", ...] = ()
    names: tuple[Word, ...] = ()


@dataclass(frozen=True)
class PlacementSyntax:
    """`actor.training dp 8 tp 4 on 0..31 offload`: the model-stage and its items in order;
    an item is ("key", key, value), ("flag", word, None) or ("on", word, set items)."""

    model_stage: Word
    items: tuple[tuple[str, Word, Union[Word, tuple[GpuSetItem, ...], None]], ...]


@dataclass(frozen=True)
class Declaration:
    """A top-level declaration. kind: cluster, model, workload, plan, transition.
    `base` is the word after `=` (model alias / architecture, plan base) or the target of a
    transition; `body` is None for a model alias written without braces."""

    kind: str
    keyword: Word
    name: Word
    base: Optional[Word] = None
    body: Optional[tuple[Entry, ...]] = None
    placements: tuple[PlacementSyntax, ...] = ()


_WORDS = {
    "NAME": "a name",
    "QUANTITY": "a number",
    "MODEL_STAGE": "a model-stage like actor.training",
    "GPU_ID": "a GPU id",
    "NODE": "a node like n2",
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
        return "a placement key (dp, tp, pp, on, offload), the next model-stage or '}'"
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


def _unclosed_brace_hint(text: str, upto: int) -> Optional[str]:
    """Where the innermost `{` still open at offset `upto` was written, if any."""
    stack: list[int] = []
    in_comment = False
    for offset, char in enumerate(text[:upto]):
        if in_comment:
            in_comment = char != "\n"
        elif char == "#":
            in_comment = True
        elif char == "{":
            stack.append(offset)
        elif char == "}" and stack:
            stack.pop()
    if not stack:
        return None
    line = text.count("\n", 0, stack[-1]) + 1
    column = stack[-1] - (text.rfind("\n", 0, stack[-1]) + 1) + 1
    return f"the '{{' at {line}:{column} is not closed"


def _syntax_error(error: UnexpectedInput, text: str, file: str) -> ParseError:
    if isinstance(error, UnexpectedToken) and error.token.type != "$END":
        token = error.token
        message = f"expected {_describe_expected(set(error.expected))}, found '{token}'"
        hint = None
        if token.type == "QUANTITY" and str(token).startswith("-") and {"GPU_ID", "NODE"} & set(error.expected):
            hint = "GPU ids are 0 or more"
        return ParseError(message, Location(file, token.line, token.column), hint, text, len(str(token)))
    if isinstance(error, (UnexpectedToken, UnexpectedEOF)):
        expected = set(error.expected)
        token = getattr(error, "token", None)
        if token is not None and token.end_line is not None:
            loc = Location(file, token.end_line, token.end_column)
        else:
            lines = text.splitlines() or [""]
            loc = Location(file, len(lines), len(lines[-1]) + 1)
        hint = _unclosed_brace_hint(text, len(text)) if "RBRACE" in expected else None
        return ParseError(f"unexpected end of input; expected {_describe_expected(expected)}", loc, hint, text)
    if isinstance(error, UnexpectedCharacters):
        char = text[error.pos_in_stream] if error.pos_in_stream < len(text) else ""
        message = f"unexpected character '{char}'"
        if error.allowed:
            message += f"; expected {_describe_expected(set(error.allowed))}"
        hint = "comments start with '#'" if char in "/;" else None
        return ParseError(message, Location(file, error.line, error.column), hint, text)
    return ParseError(str(error).splitlines()[0], None, None, text)


def _word(token: Token, file: str) -> Word:
    return Word(str(token), Location(file, token.line, token.column))


def parse_syntax(text: str, file: str = "<input>") -> tuple[Declaration, ...]:
    """Input: source text. Output: its declarations in order. Raises ParseError (with the
    source attached) when the text does not follow the grammar."""
    try:
        tree = _PARSER.parse(text)
    except UnexpectedInput as error:
        raise _syntax_error(error, text, file) from None
    return tuple(_declaration(node, file) for node in tree.children)


def _declaration(node: Tree, file: str) -> Declaration:
    kind = node.data
    children = node.children
    keyword = Word(kind, Location(file, node.meta.line, node.meta.column))
    name = _word(children[0], file)
    if kind in ("cluster", "workload"):
        return Declaration(kind, keyword, name, body=_block(children[1], file))
    if kind == "model":
        body = _block(children[2], file) if len(children) > 2 else None
        return Declaration(kind, keyword, name, _word(children[1], file), body)
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
        elif child.data == "sub":
            entries.append(Entry(key, "block", block=_block(child.children[1], file)))
        else:
            entries.append(Entry(key, "list", names=tuple(_word(t, file) for t in child.children[1:])))
    return tuple(entries)


def _placement(node: Tree, file: str) -> PlacementSyntax:
    items = []
    for child in node.children[1:]:
        if child.data == "pkey":
            items.append(("key", _word(child.children[0], file), _word(child.children[1], file)))
        elif child.data == "pflag":
            items.append(("flag", _word(child.children[0], file), None))
        else:
            on = Word("on", Location(file, child.meta.line, child.meta.column))
            items.append(("on", on, tuple(_gpu_item(item, file) for item in child.children[0].children)))
    return PlacementSyntax(_word(node.children[0], file), tuple(items))


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

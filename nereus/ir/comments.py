"""Keep a file's comments through `nereusc fmt`.

The Module holds no comments (they carry no meaning). To reformat a file without losing
them, each comment is tied to an *anchor* of the syntax tree — the declaration, key or
placement on its line (a trailing comment) or on the next line that has one (a comment
on its own line) — and the printer puts it back at the same anchor in the canonical
text. A comment after the last declaration stays at the end of the file, one above the
first declaration at its top (the canonical order may print another declaration first),
and one inside a model's block above that model (a model prints on one line). A comment
whose anchor is not printed (e.g. a default that the canonical form leaves out) moves
to a line of its own at the end of its block, or else above the nearest enclosing
anchor that is printed.
"""

from __future__ import annotations

import bisect
from typing import Iterable

from .model import Module
from .overrides import apply_overrides
from .parser import parse_source
from .printer import Anchor, print_lines, print_module
from .diagnostics import source_lines
from .syntax import Declaration, parse_syntax

_WORKLOAD_COUNTS = ("batch", "prompt", "response", "microbatch")


def _comment_start(line: str) -> int:
    """The offset of the `#` that starts the line's comment, or -1. A `#` inside a quoted
    string (`hf("ckpt#2")`) starts none; strings do not span lines."""
    quoted = False
    for offset, char in enumerate(line):
        if char == '"':
            quoted = not quoted
        elif char == "#" and not quoted:
            return offset
    return -1


def _comments(text: str) -> list[tuple[int, str, bool]]:
    """(line, comment text, stands alone on its line) for every `#` comment. A comment on
    its own line followed by a blank line is followed by an empty comment "", which
    prints as that blank line."""
    found = []
    lines = source_lines(text)
    for number, line in enumerate(lines, start=1):
        index = _comment_start(line)
        if index >= 0:
            alone = not line[:index].strip()
            found.append((number, line[index:].rstrip(), alone))
            if alone and number < len(lines) and not lines[number].strip():
                found.append((number, "", True))
    return found


def _anchors(decls: Iterable[Declaration]) -> list[tuple[int, Anchor]]:
    """(line, anchor) of every anchored element, in source order."""
    anchors: list[tuple[int, Anchor]] = []
    for decl in decls:
        if decl.kind == "cluster":
            anchors.append((decl.keyword.loc.line, ("cluster",)))
            anchors.extend((entry.key.loc.line, ("cluster", entry.key.text)) for entry in decl.body)
        elif decl.kind == "model":
            anchors.append((decl.keyword.loc.line, ("model", decl.name.text)))
        elif decl.kind == "workload":
            anchors.append((decl.keyword.loc.line, ("workload",)))
            for entry in decl.body:
                key = "counts" if entry.key.text in _WORKLOAD_COUNTS else entry.key.text
                anchors.append((entry.key.loc.line, ("workload", key)))
        elif decl.kind == "plan":
            anchors.append((decl.keyword.loc.line, ("plan", decl.name.text)))
            anchors.extend((p.model_stage.loc.line, ("plan", decl.name.text, p.model_stage.text))
                           for p in decl.placements)
        else:
            anchors.append((decl.keyword.loc.line, ("transition", decl.name.text, decl.base.text)))
        if decl.kind in ("cluster", "workload", "plan") and decl.end_line > decl.keyword.loc.line:
            block = ("plan", decl.name.text) if decl.kind == "plan" else (decl.kind,)
            anchors.append((decl.end_line, block + ("}",)))
    return sorted(anchors, key=lambda item: item[0])


def _printed(anchor: Anchor, printed: set[Anchor]) -> Anchor | None:
    while anchor and anchor not in printed:
        anchor = anchor[:-1]
    return anchor or None


def format_source(text: str, file: str = "<input>", overrides: Iterable[str] = ()) -> str:
    """Input: `.nir` source (and optional `--set` overrides). Output: its canonical text
    with the source's comments kept. Invariant: the output parses to the same Module as
    the input (after overrides), and format_source(output) == output."""
    module: Module = apply_overrides(parse_source(text, file), overrides)
    decls = parse_syntax(text, file)
    anchors = _anchors(decls)
    lines = [line for line, _ in anchors]
    groups = print_lines(module)
    printed = {anchor for group in groups for anchor, _ in group}
    # a model prints on one line: a comment inside its block goes above it
    models = [(d.keyword.loc.line, d.end_line, ("model", d.name.text)) for d in decls if d.kind == "model"]
    # comments above the first declaration head the file when another one prints first
    header = bool(anchors) and bool(groups) and groups[0][0][0] != anchors[0][1]
    before: dict[Anchor, list[str]] = {}
    after: dict[Anchor, list[str]] = {}
    head: list[str] = []
    tail: list[str] = []
    for line, comment, alone in _comments(text):
        inside = next((model for start, end, model in models if start < line <= end), None) if alone else None
        if alone and header and line < anchors[0][0]:
            head.append(comment)
            continue
        if inside is not None:
            before.setdefault(inside, []).append(comment)
            continue
        if alone:
            index = bisect.bisect_right(lines, line)  # the next anchored line
            if index == len(anchors):
                tail.append(comment)
                continue
            target, into = anchors[index][1], before
        else:
            index = bisect.bisect_right(lines, line) - 1  # the anchor on this line (or above)
            target, into = anchors[max(index, 0)][1], after
        anchor = _printed(target, printed)
        closing = target[:-1] + ("}",)
        if anchor != target and len(target) >= 2 and closing in printed:
            anchor, into = closing, before  # a key the canonical form leaves out: keep it in its block
        if anchor is None:
            tail.append(comment)
        elif into is before or anchor == target:
            into.setdefault(anchor, []).append(comment)
        else:  # a trailing comment whose key is not printed: above its enclosing line
            before.setdefault(anchor, []).append(comment)
    return print_module(module, before, after, tail, head)

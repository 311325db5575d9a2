"""Every environment variable the package reads is in README's "Environment variables"
table: a switch a user cannot find is a switch nobody measures."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# os.environ.get("NEREUS_X" ...), os.environ["NEREUS_X"], "NEREUS_X" in os.environ,
# env_number("NEREUS_X", ...), env_flag("NEREUS_X", ...) (nereus.ir.diagnostics: a checked number or switch)
READS = re.compile(r"""(?:environ(?:\.get\(|\[)|env_number\(|env_flag\()\s*["'](NEREUS_[A-Z0-9_]+)["']|["'](NEREUS_[A-Z0-9_]+)["']\s+(?:not\s+)?in\s+os\.environ""")


def _read_by_the_package() -> set:
    names = set()
    for path in (ROOT / "nereus").rglob("*.py"):
        for match in READS.finditer(path.read_text()):
            names.add(match.group(1) or match.group(2))
    return names


def _documented() -> set:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"`(NEREUS_[A-Z0-9_]+)`", section))


def test_the_scan_finds_the_reads():
    # the pattern must see the reads it is meant for, or the test below proves nothing
    assert {"NEREUS_PAUSE_GC", "NEREUS_P2P_CHUNK_BYTES", "NEREUS_PACK_JIT", "NEREUS_FAILURE_TIMEOUT_S"} <= \
        _read_by_the_package()


def test_every_variable_read_is_documented_and_every_documented_one_is_read():
    read, documented = _read_by_the_package(), _documented()
    assert read - documented == set(), "read but not in README's table"
    assert documented - read == set(), "in README's table but never read"

"""The project's docs stand alone: no reference to files outside the repository; the
language reference covers every construct; docs/api.md's example runs as printed."""

import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_no_reference_to_files_outside_the_repository():
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    offenders = []
    for name in listed:
        path = ROOT / name
        if path.suffix in (".py", ".md", ".lark", ".nir", ".toml", ".sh", ".txt") and path.is_file():
            text = path.read_text(encoding="utf-8", errors="replace")
            if re.search(r"\b(DESIGN|MODELS)\.md\b", text) and name != "tests/test_docs.py":
                offenders.append(name)
    assert offenders == []


def test_language_reference_covers_every_construct_and_rule():
    text = (ROOT / "docs" / "ir.md").read_text()
    for heading in ("### cluster", "### model", "### workload", "### plan", "### transition",
                    "## Values and units", "### Ranges", "## GPU sets and the mesh order",
                    "## Rules the compiler enforces", "## The memory model"):
        assert heading in text
    from nereus.ir.build import CLUSTER_KEYS, GPU_KEYS, MODEL_KEYS, PLACEMENT_KEYS, WORKLOAD_KEYS
    from nereus.ir.units import FLOPS_UNITS, RATE_UNITS, SIZE_UNITS

    for key in [*CLUSTER_KEYS, *GPU_KEYS, *MODEL_KEYS, *WORKLOAD_KEYS, *PLACEMENT_KEYS]:
        assert f"`{key}" in text, key
    for unit in [*SIZE_UNITS, *RATE_UNITS, *FLOPS_UNITS]:
        assert f"`{unit}`" in text, unit


def test_api_example_runs_as_printed(monkeypatch, capsys):
    text = (ROOT / "docs" / "api.md").read_text()
    (code,) = re.findall(r"```python\n(.*?)```", text, re.S)
    monkeypatch.chdir(ROOT)
    exec(compile(code, "docs/api.md", "exec"), {})
    assert capsys.readouterr().out.splitlines()[-1].startswith("ok: ")

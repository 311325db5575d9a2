"""The house: packages import only downward (ir → models → passes → backends →
runtime | controller → interop → rl → cli) and no two modules import each other, lazily or
not. interop, the adapter layer between PyTorch modules and Nereus, sits above the
runtime: the compiler and the runtime never import it."""

import ast
import pathlib

import networkx as nx

ROOT = pathlib.Path(__file__).resolve().parents[1] / "nereus"
RANK = {"ir": 0, "models": 1, "passes": 2, "backends": 3, "runtime": 4, "controller": 4, "interop": 5, "rl": 6,
        "cli": 7}


def _imports():
    """(importer module, imported module) for every nereus import, including those
    inside functions (a lazy import against the flow is still against it)."""
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        package = module if parts[-1] == "__init__" else module.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if target.startswith("nereus"):
                    yield module, target
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("nereus"):
                        yield module, alias.name


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_packages_import_only_downward():
    against = sorted(
        f"{a} imports {b}"
        for a, b in _imports()
        if _package(a) in RANK and _package(b) in RANK and _package(a) != _package(b)
        and RANK[_package(b)] >= RANK[_package(a)]
    )
    assert against == []


def test_no_import_cycle_between_modules():
    modules = {".".join(p.relative_to(ROOT.parent).with_suffix("").parts) for p in ROOT.rglob("*.py")}

    def resolve(name):  # `from nereus.x import y` names module nereus.x (or nereus.x.y)
        while name and name not in modules and name + ".__init__" not in modules:
            name = name.rsplit(".", 1)[0] if "." in name else ""
        return name

    graph = nx.DiGraph()
    for a, b in _imports():
        b = resolve(b)
        # a package's __init__ re-exporting its own modules is not a cycle of the design
        if b and b != a and not b.startswith(a + ".") and not a.startswith(b + "."):
            graph.add_edge(a, b)
    assert list(nx.simple_cycles(graph)) == []

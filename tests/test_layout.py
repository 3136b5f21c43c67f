"""The package's layers point one way and its modules import each other without a cycle (lazy imports included),
read from the source with `ast`, so a new cycle fails here before it fails at import time in some order."""

import ast
from pathlib import Path

from conftest import ROOT

PACKAGE = ROOT / "wapstable"
# Lower layers never import the higher ones: data, model, stability and evaluation are used by the trainer and the
# command-line tools, not the other way round.
LOWER = ("wapstable.data", "wapstable.model", "wapstable.stability", "wapstable.eval")
HIGHER = ("wapstable.train", "wapstable.cli")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> dict[str, set[str]]:
    """Each module of the package -> the package's modules it imports anywhere in its file."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("wapstable"):
                assert node.level == 0, f"{name}: relative import"
                for alias in node.names:  # `from wapstable.train import distributed` names a module
                    sub = f"{node.module}.{alias.name}"
                    found.add(sub if sub in modules else node.module)
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.startswith("wapstable")}
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def test_lower_layers_do_not_import_the_trainer_or_the_tools():
    wrong = [
        (m, d) for m, deps in imports().items() if m.startswith(LOWER) for d in deps if d.startswith(HIGHER)
    ]
    assert not wrong, wrong


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of `graph` (module -> modules it imports), each as a path that ends where it starts: a
    depth-first search that meets a module already on its path."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    cycles = []

    def visit(m, path):
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycles.append(path[path.index(d) :] + [d])
            elif d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return cycles


def test_no_import_cycle():
    cycles = find_cycles(imports())
    assert not cycles, cycles


def test_the_checker_sees_a_cycle(tmp_path, monkeypatch):
    """The cycle test can fail: two modules importing each other (one of them lazily, in a function) are read as
    such from their files, and the search finds the cycle."""
    pkg = tmp_path / "wapstable"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from wapstable.b import x\n")
    (pkg / "b.py").write_text("def f():\n    from wapstable.a import y\n")
    (pkg / "c.py").write_text("import wapstable.a\n")  # imports into the cycle, not part of it
    monkeypatch.setattr(__import__(__name__), "PACKAGE", pkg)
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    graph = imports()
    assert graph["wapstable.a"] == {"wapstable.b"} and graph["wapstable.b"] == {"wapstable.a"}
    assert find_cycles(graph) == [["wapstable.a", "wapstable.b", "wapstable.a"]]
    # a longer cycle, entered from outside it, and a graph without one
    ring = {"p": {"q"}, "q": {"r"}, "r": {"p", "s"}, "s": set(), "o": {"q"}}
    assert find_cycles(ring) == [["q", "r", "p", "q"]]
    assert find_cycles({**ring, "r": {"s"}}) == []


def test_only_the_entry_points_exit():
    """Library code raises (UserError, TrainingStopped); only `wapstable.cli` turns that into an exit status."""
    exits = []
    for path in PACKAGE.rglob("*.py"):
        name = module_name(path)
        if name.startswith("wapstable.cli"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("exit", "_exit"):
                if isinstance(node.value, ast.Name) and node.value.id in ("sys", "os"):
                    exits.append(f"{name}:{node.lineno}")
    assert not exits, exits


def test_no_module_of_the_package_is_over_500_lines():
    long = {module_name(p): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > 500}
    assert long == {}, "split these modules by what their parts are"


def private_imports() -> list[str]:
    """`from wapstable.X import _name` anywhere in the package: one module reaching into another's private names."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("wapstable"):
                found += [
                    f"{module_name(path)}: {node.module}.{a.name}"
                    for a in node.names
                    if a.name.startswith("_")
                ]
    return found


def test_no_module_imports_another_modules_private_names(tmp_path, monkeypatch):
    assert private_imports() == []
    # the check sees one: a module of a copy of the package that imports a private name
    fake = tmp_path / "wapstable"
    fake.mkdir()
    (fake / "a.py").write_text("from wapstable.b import _hidden\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake)
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert private_imports() == ["wapstable.a: wapstable.b._hidden"]

"""The layers hold: no module imports a higher layer, and no two modules import each other, however indirectly.

The layers, lowest first (harness/__init__.py draws them): harness.core -> harness.store -> proxy -> harness.running
-> trainer -> adapters -> harness.cli and harness.viewer. The trainer is layers too, its rooms (trainer/__init__.py
draws them): trainer.maths -> trainer.model -> trainer.config -> trainer.rl -> trainer.offline, and no module of the
trainer sits outside them. Every import counts, also one inside a function (a lazy
import is still a dependency); only `if TYPE_CHECKING:` blocks are passed over. A failure names the importing file,
its line and the import.
"""

from __future__ import annotations

import ast
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("harness", "proxy", "trainer", "adapters")
LAYERS = (  # (module prefix, layer): the longest matching prefix decides
    ("harness", 0), ("harness.core", 0),
    ("harness.store", 1),
    ("proxy", 2),
    ("harness.running", 3), ("harness.sandbox", 3),
    ("trainer", 4), ("trainer.maths", 4),  # the trainer's rooms, lowest first
    ("trainer.model", 5),
    ("trainer.config", 6),
    ("trainer.rl", 7),
    ("trainer.offline", 8),
    ("adapters", 9),
    ("harness.cli", 10), ("harness.viewer", 10),
)
LAYER_NAMES = ("core", "store", "proxy", "running", "trainer.maths", "trainer.model", "trainer.config", "trainer.rl",
               "trainer.offline", "adapters", "cli/viewer")
TRAINER_ROOMS = ("trainer.maths", "trainer.model", "trainer.config", "trainer.rl", "trainer.offline")


@dataclass(frozen=True)
class Import:
    importer: str  # the module that imports
    imported: str  # the module it imports (a package's submodule when `from package import submodule`)
    where: str  # file:line


def layer_of(module: str) -> int:
    best = max((p for p, _ in LAYERS if module == p or module.startswith(p + ".")), key=len, default=None)
    if best is None:
        raise ValueError(f"module {module!r} is in no layer: add its package to LAYERS in tests/test_layers.py")
    return dict(LAYERS)[best]


def modules(root: Path) -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports_in(node: ast.AST, name: str, package: str, where: Path, known: dict[str, Path],
                found: list[Import]) -> None:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _type_checking(child):
            for other in child.orelse:
                _imports_in(other, name, package, where, known, found)
            continue
        targets: list[str] = []
        if isinstance(child, ast.Import):
            targets = [a.name for a in child.names]
        elif isinstance(child, ast.ImportFrom):
            if child.level:
                base = package.split(".")[: len(package.split(".")) - child.level + 1]
                source = ".".join([*base, *([child.module] if child.module else [])])
            else:
                source = child.module or ""
            targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in known else source for a in child.names]
        found.extend(Import(name, t, f"{where}:{child.lineno}") for t in targets if t.split(".")[0] in PACKAGES)
        _imports_in(child, name, package, where, known, found)


def imports(root: Path) -> list[Import]:
    """Every import of one of our modules by another, with where it stands."""
    known = modules(root)
    found: list[Import] = []
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        _imports_in(ast.parse(path.read_text(), filename=str(path)), name, package, path.relative_to(root), known,
                    found)
    return found


def upward(root: Path) -> list[str]:
    """Imports of a higher layer, as sentences."""
    return [f"{i.where}: {i.importer} ({LAYER_NAMES[layer_of(i.importer)]}) imports {i.imported} "
            f"({LAYER_NAMES[layer_of(i.imported)]}), a higher layer" for i in imports(root)
            if layer_of(i.imported) > layer_of(i.importer)]


def outside_rooms(root: Path) -> list[str]:
    """Modules of the trainer in none of its rooms (a loose trainer/x.py, a new trainer/x/), as file paths."""
    return [str(path.relative_to(root)) for name, path in modules(root).items()
            if name.startswith("trainer.") and not any(name == r or name.startswith(r + ".") for r in TRAINER_ROOMS)]


def cycles(root: Path) -> list[list[str]]:
    """Groups of modules that import each other (strongly connected components of more than one module, or a module
    importing itself); a package's __init__ importing its own submodules is no cycle unless they import it back."""
    known = modules(root)
    edges: dict[str, set[str]] = {m: set() for m in known}
    for i in imports(root):
        target = i.imported
        while target not in known and "." in target:  # `import a.b.c` of a name inside a module
            target = target.rpartition(".")[0]
        if target in known and target != i.importer:
            edges[i.importer].add(target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return groups


def test_every_module_sits_in_a_layer():
    for name in modules(ROOT):
        layer_of(name)  # raises, naming the module


def test_no_module_imports_a_higher_layer():
    found = upward(ROOT)
    assert not found, "imports across the layers, upwards:\n" + "\n".join(found)


def test_every_trainer_module_sits_in_a_room():
    found = outside_rooms(ROOT)
    assert not found, (f"modules directly in trainer/: {', '.join(found)}; move each into the room it belongs to "
                       f"({', '.join(TRAINER_ROOMS)}) or add a room to TRAINER_ROOMS and LAYERS")


def test_no_import_cycles():
    found = cycles(ROOT)
    assert not found, "modules that import each other:\n" + "\n".join(" <-> ".join(g) for g in found)


@pytest.fixture
def tree(tmp_path) -> Path:
    """A copy of our packages to plant imports in."""
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__", "static"))
    return tmp_path


def test_a_planted_upward_import_is_found_and_named(tree: Path):
    records = tree / "harness" / "core" / "records.py"
    records.write_text(records.read_text() + "\n\ndef _late():\n    from trainer.rl.loop import train  # planted\n")
    found = upward(tree)
    assert len(found) == 1
    assert found[0].startswith("harness/core/records.py:")
    assert "harness.core.records (core) imports trainer.rl.loop (trainer.rl), a higher layer" in found[0]


def test_a_planted_import_of_a_higher_trainer_room_is_found_and_named(tree: Path):
    estimators = tree / "trainer" / "maths" / "estimators.py"
    text = estimators.read_text() + "\n\ndef _late():\n    from trainer.model.policy import collate  # planted\n"
    estimators.write_text(text)
    found = upward(tree)
    assert found == [f"trainer/maths/estimators.py:{text.count(chr(10))}: trainer.maths.estimators (trainer.maths) "
                     "imports trainer.model.policy (trainer.model), a higher layer"]


def test_a_planted_loose_trainer_module_is_found(tree: Path):
    (tree / "trainer" / "helpers.py").write_text("")
    (tree / "trainer" / "extra").mkdir()
    (tree / "trainer" / "extra" / "__init__.py").write_text("")
    assert outside_rooms(tree) == ["trainer/extra/__init__.py", "trainer/helpers.py"]


def test_a_planted_cycle_is_found(tree: Path):
    (tree / "trainer" / "planted_a.py").write_text("from trainer import planted_b\n")
    (tree / "trainer" / "planted_b.py").write_text("import trainer.planted_a\n")
    assert cycles(tree) == [["trainer.planted_a", "trainer.planted_b"]]
    assert not upward(tree)  # the same layer


def test_type_checking_imports_do_not_count(tree: Path):
    store = tree / "harness" / "store" / "live.py"
    store.write_text(store.read_text() + "\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                     "    from proxy.server import ProxyServer\n")
    assert not upward(tree)


APP_KEYS = {"CONFIG", "STATE", "STORE", "RECORDER", "EPISODES", "SESSION", "ENGINES", "RESPONSES"}


def app_key_uses(root: Path, folders=("harness", "trainer", "adapters", "tests", "bench", "examples")) -> list[str]:
    """Code outside proxy/ that touches the proxy's aiohttp app keys (proxy/state.py), by import or by subscript:
    what it needs of a running proxy is a method of proxy.server.ProxyServer."""
    found = []
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            if ".venv" in path.parts or "node_modules" in path.parts:
                continue
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                where = f"{path.relative_to(root)}:{getattr(node, 'lineno', 0)}"
                if isinstance(node, ast.ImportFrom) and node.module in ("proxy.state", "proxy.app"):
                    keys = sorted(a.name for a in node.names if a.name in APP_KEYS or node.module == "proxy.state")
                    if keys:
                        found.append(f"{where}: imports {', '.join(keys)} from {node.module}")
                elif isinstance(node, ast.Import) and any(a.name == "proxy.state" for a in node.names):
                    found.append(f"{where}: imports proxy.state")
                elif (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Name) and node.slice.id in APP_KEYS
                      and "app" in (getattr(node.value, "attr", None), getattr(node.value, "id", None))):
                    found.append(f"{where}: reads the proxy app's {node.slice.id}")
    return found


def test_nothing_outside_the_proxy_touches_its_app_keys():
    found = app_key_uses(ROOT)
    assert not found, "use proxy.server.ProxyServer's methods instead:\n" + "\n".join(found)


def test_a_planted_app_key_use_is_found(tmp_path: Path):
    (tmp_path / "trainer").mkdir()
    (tmp_path / "trainer" / "x.py").write_text("from proxy.app import STORE\n\n\ndef f(server):\n"
                                               "    return server.app[STORE]\n")
    assert app_key_uses(tmp_path, folders=("trainer",)) == [
        "trainer/x.py:1: imports STORE from proxy.app", "trainer/x.py:5: reads the proxy app's STORE"]


def test_importing_a_parser_or_the_config_does_not_load_the_server():
    import subprocess
    import sys

    code = ("import sys, proxy.parsing.native, proxy.config, proxy.roles, proxy.guard\n"
            "loaded = [m for m in ('proxy.app', 'proxy.server', 'aiohttp', 'duckdb') if m in sys.modules]\n"
            "print(','.join(loaded))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""

"""The package's structure: imports go one way.

cct's import graph is read from the source (every ``import`` and ``from ... import``, at module level and
inside functions; ``if TYPE_CHECKING:`` blocks, which never run, left out) and must have no cycle: a
function-level import does not hide one. A package's ``__init__`` counts as a module (``from .. import
blas`` imports it).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("cct", "caffe")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _under_type_checking(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The module of ours that importing ``name`` runs (a name imported from a package: the package)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """``{module: the modules of ours it imports}``."""
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            if _under_type_checking(node, parents):
                continue
            for t in targets:
                owner = _owner(t, modules)
                if owner is not None and owner != mod:
                    graph[mod].add(owner)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_imports_have_no_cycle():
    found = cycles(import_graph(_modules()))
    assert not found, "import cycles (module- and function-level imports): " + "; ".join(
        " <-> ".join(c) for c in found)


def test_the_cycle_check_finds_a_cycle(tmp_path):
    """The check is not vacuous: a function-level import back into a package's user is a cycle."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("from . import b\n")
    (tmp_path / "pkg" / "b.py").write_text("def f():\n    from .a import g\n")
    (tmp_path / "pkg" / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n")
    modules = {name: tmp_path / "pkg" / f"{name.split('.')[-1]}.py" for name in ("pkg.a", "pkg.b", "pkg.c")}
    modules["pkg"] = tmp_path / "pkg" / "__init__.py"
    assert cycles(import_graph(modules)) == [["pkg.a", "pkg.b"]]


@pytest.mark.parametrize("package", PACKAGES)
def test_every_module_is_read(package):
    modules = _modules()
    assert any(m.startswith(package + ".") for m in modules) and package in modules


# -- process-wide state: a ratchet (issue 29 removes these; none may be added) ---------------------------
GLOBAL_STATEMENTS = {  # file -> `global` statements allowed there today
    "cct/blas/mkl.py": 1, "cct/blas/openblas.py": 3, "cct/blas/spin.py": 1,
    "cct/config.py": 3, "cct/distributed/comm.py": 1, "cct/malloc.py": 1,
}


def test_no_new_global_statement():
    found: dict[str, int] = {}
    for path in _modules().values():
        n = sum(isinstance(node, ast.Global) for node in ast.walk(ast.parse(path.read_text())))
        if n:
            found[path.relative_to(ROOT).as_posix()] = n
    grown = {f: n for f, n in found.items() if n > GLOBAL_STATEMENTS.get(f, 0)}
    assert not grown, f"new `global` statements (pass state as objects instead): {grown}"


# Module-level containers created empty and filled at run time: process-wide state. Allowed only these names, each
# per process for a reason; anything else belongs to an object a Config, Net, layer or test owns (issue 29).
MODULE_STATE = {
    "_REGISTRY": "the layer registry (cct.layers.base), filled as the layer modules are imported",
    "_STRATEGIES": "the lowering-strategy registry (cct.lowering.base), filled as the strategies are imported",
    "_SOLVERS": "the solver registry, filled as the solver types are imported",
    "_thread": "each thread's BLAS backend (cct.blas.choice): a threading.local, one value per thread",
    "FORWARD_DRIVERS": "numba-compiled conv forward drivers (cct.kernels.conv_simd): compiled code lives in a process",
    "_fixed": "numba-compiled pooling variants (cct.kernels.pooling): compiled code lives in the process",
}
_CONTAINERS = ("dict", "list", "set", "defaultdict", "OrderedDict", "deque", "threading.local",
               "weakref.WeakValueDictionary", "weakref.WeakKeyDictionary", "collections.OrderedDict",
               "collections.defaultdict", "collections.deque")


def module_state(tree: ast.Module) -> list[str]:
    """The names a module binds, at its top level, to an empty container (to be filled at run time)."""
    names = []
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        empty = (isinstance(value, ast.Dict) and not value.keys) or \
            (isinstance(value, (ast.List, ast.Set)) and not value.elts) or \
            (isinstance(value, ast.Call) and ast.unparse(value.func) in _CONTAINERS and not value.args
             and not value.keywords)
        if empty:
            names += [ast.unparse(t) for t in targets]
    return names


def test_no_new_module_level_state():
    found = {f"{path.relative_to(ROOT).as_posix()}: {name}" for path in _modules().values()
             for name in module_state(ast.parse(path.read_text())) if name not in MODULE_STATE}
    assert not found, f"module-level state (own it by an object instead, or say why it is per process): {found}"


def test_the_module_state_check_finds_state():
    tree = ast.parse("A = {}\nB: list[int] = []\nC = dict()\nD = {'x': 1}\nE = dict(a=1)\nF = threading.local()\n"
                     "def f():\n    g = {}\n")
    assert module_state(tree) == ["A", "B", "C", "F"]


def test_the_strategy_registry_refuses_a_second_strategy_of_one_name():
    from cct.lowering import base, get_strategy

    class Other(base.LoweringStrategy):
        name = "type1"

    with pytest.raises(ValueError, match="'type1' is registered already"):
        base.register_strategy("type1", Other)
    assert type(get_strategy("type1")).__name__ == "Type1Lowering"
    base.register_strategy("type1", base.registry_factory("type1"))  # the same factory again: a no-op
    with pytest.raises(KeyError, match="unknown lowering 'nope'"):
        base.unregister_strategy("nope")


# -- environment variables: declared once (cct/env.py), read through it --------------------------------------
def _cct_literals(tree: ast.AST) -> set[str]:
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and n.value.startswith("CCT_") and n.value.rstrip("_").replace("_", "").isalnum() and n.value.isupper()}


def test_every_cct_variable_is_declared_and_read_through_cct_env():
    from cct import env

    declared = {k.name for k in env.KNOBS}
    for mod, path in _modules().items():
        tree = ast.parse(path.read_text())
        unknown = _cct_literals(tree) - declared
        assert not unknown, f"{path.relative_to(ROOT)}: {sorted(unknown)} not declared in cct/env.py"
        if mod == "cct.env":
            continue
        for node in ast.walk(tree):
            direct = (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                      and ast.unparse(node.func.value) == "os.environ" and node.args
                      and isinstance(node.args[0], ast.Constant) and str(node.args[0].value).startswith("CCT_"))
            direct |= (isinstance(node, ast.Subscript) and ast.unparse(node.value) == "os.environ"
                       and isinstance(node.slice, ast.Constant) and str(node.slice.value).startswith("CCT_"))
            assert not direct, f"{path.relative_to(ROOT)}:{node.lineno}: read CCT_* through cct.env"


def test_the_variables_table_is_in_the_command_reference():
    from cct import env

    assert env.markdown_table() in (ROOT / "docs" / "commands.md").read_text()


def test_env_reads_values_when_called(monkeypatch):
    from cct import env

    monkeypatch.delenv("CCT_BLAS", raising=False)
    assert env.text("CCT_BLAS") == "auto" and not env.is_set("CCT_BLAS")
    monkeypatch.setenv("CCT_BLAS", " MKL ")
    assert env.text("CCT_BLAS") == "MKL" and env.is_set("CCT_BLAS")
    monkeypatch.setenv("CCT_TUNE", "yes")
    assert env.flag("CCT_TUNE") and not env.is_off("CCT_TUNE")
    monkeypatch.setenv("CCT_TUNE", "off")
    assert not env.flag("CCT_TUNE") and env.is_off("CCT_TUNE")
    monkeypatch.delenv("CCT_PROGRESS", raising=False)
    assert not env.is_off("CCT_PROGRESS")  # unset is not off
    with pytest.raises(KeyError, match="CCT_NOPE is not one of cct's environment variables"):
        env.text("CCT_NOPE")


def patched_privates(tree: ast.Module) -> list[str]:
    """The private names (``_x``, not dunders) a test file's ``monkeypatch.setattr``/``setitem`` calls replace."""
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("setattr", "delattr") and ast.unparse(node.func.value) == "monkeypatch"):
            continue
        args = node.args
        if args and isinstance(args[0], ast.Constant) and isinstance(args[0].value, str):
            name = args[0].value.rsplit(".", 1)[-1]  # monkeypatch.setattr("pkg.mod.name", value)
        elif len(args) > 1 and isinstance(args[1], ast.Constant) and isinstance(args[1].value, str):
            name = args[1].value
        else:
            continue
        if name.startswith("_") and not name.startswith("__"):
            found.append(f"line {node.lineno}: {name}")
    return found


def test_no_test_monkeypatches_a_private():
    found = {f"{path.name}: {hit}" for path in sorted((ROOT / "tests").glob("*.py"))
             for hit in patched_privates(ast.parse(path.read_text()))}
    assert not found, f"tests replacing another module's privates (give it a public seam instead): {found}"


def test_the_private_patch_check_finds_them():
    tree = ast.parse("def t(monkeypatch):\n    monkeypatch.setattr(mod, '_x', 1)\n"
                     "    monkeypatch.setattr('a.b._y', 2)\n    monkeypatch.setattr(mod, 'z', 3)\n"
                     "    monkeypatch.setattr(mod, '__doc__', 'd')\n")
    assert patched_privates(tree) == ["line 2: _x", "line 3: _y"]


def function_level_cct_imports(tree: ast.Module) -> list[int]:
    """Lines where a function imports one of cct's own modules (relative or ``cct.``) instead of the module top."""
    lines = []
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and (node.level > 0 or (node.module or "").split(".")[0] == "cct"):
                    lines.append(node.lineno)
                elif isinstance(node, ast.Import) and any(a.name.split(".")[0] == "cct" for a in node.names):
                    lines.append(node.lineno)
    return sorted(set(lines))


def test_cct_modules_are_imported_at_module_level():
    # with no cycle left, a function-level import of cct's own code only hides a dependency (optional
    # third-party libraries such as cupy, h5py, mpi4py stay lazy)
    found = {f"{path.relative_to(ROOT).as_posix()}:{line}" for path in _modules().values()
             for line in function_level_cct_imports(ast.parse(path.read_text()))}
    assert not found, f"function-level imports of cct modules (import at the top): {sorted(found)}"


def test_the_function_level_import_check_finds_them():
    tree = ast.parse("import numpy\ndef f():\n    from . import a\n    import cct.b\n    import cupy\n"
                     "    from cct.c import d\n    from scipy import e\n")
    assert function_level_cct_imports(tree) == [3, 4, 6]

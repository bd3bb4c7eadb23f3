"""Private torch and megatron-core APIs are used from megatron_ext/platform/ only.

Each use there is listed with the versions it was checked against (platform/versions.py); a use
anywhere else would escape that check. The source outside platform/ is parsed and searched for
the forms such a use takes: a private name reached from a torch or megatron import, a private
torch/megatron module imported, a private member that megatron_ext does not define itself, a
torch or megatron attribute assigned (monkeypatching), a class swapped (`__class__ =`), a
function's code rebound (`__code__` / `__globals__`) and a module executed again (`exec_module`).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path
from typing import Optional

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_ext"
UPSTREAM = ("torch", "megatron")
# Dunder-free private names of Python's own that are public by convention (namedtuple's API).
PYTHON_CONVENTIONS = {"_replace", "_asdict", "_fields", "_make"}

def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.endswith("__")


def _is_upstream(module: str) -> bool:
    return module.split(".")[0] in UPSTREAM


def _chain(node: ast.AST) -> tuple[Optional[str], list[str]]:
    """The root name and the attribute names of `a.b.c` (root None for `f().b`)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return (node.id if isinstance(node, ast.Name) else None), parts[::-1]


def _defined_private_names(files: list[Path]) -> set[str]:
    """Every private name megatron_ext defines: functions, classes, attributes and globals."""
    names = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "getattr"):
                if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
                    names.add(node.args[1].value)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
                names.add(node.value)  # __dict__ keys, e.g. `module.__dict__["_elastic_rules"]`
    return {n for n in names if _is_private(n)}


class _Finder(ast.NodeVisitor):
    def __init__(self, own_private: set[str]) -> None:
        self.own_private = own_private
        self.upstream: set[str] = set()  # names bound to torch / megatron modules and objects
        self.function: list[str] = [""]
        self.found: list[tuple[int, str, str]] = []  # (line, enclosing function, what)

    def _hit(self, node: ast.AST, what: str) -> None:
        self.found.append((node.lineno, self.function[-1], what))

    def visit_FunctionDef(self, node) -> None:
        self.function.append(node.name)
        self.generic_visit(node)
        self.function.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if _is_upstream(alias.name):
                self.upstream.add(alias.asname or alias.name.split(".")[0])
                if any(_is_private(p) for p in alias.name.split(".")):
                    self._hit(node, f"import {alias.name}")

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module and _is_upstream(node.module):
            for alias in node.names:
                self.upstream.add(alias.asname or alias.name)
                if any(_is_private(p) for p in [*node.module.split("."), alias.name]):
                    self._hit(node, f"from {node.module} import {alias.name}")

    def visit_Attribute(self, node: ast.Attribute) -> None:
        root, parts = _chain(node)
        if node.attr in ("__code__", "__globals__"):
            self._hit(node, f"function internals .{node.attr}")
        elif _is_private(node.attr):
            if root in self.upstream:
                self._hit(node, f"{root}.{'.'.join(parts)}")
            elif root not in ("self", "cls") and node.attr not in self.own_private | PYTHON_CONVENTIONS:
                self._hit(node, f"private member .{node.attr}, not megatron_ext's")
        self.generic_visit(node)

    def _assigned(self, target: ast.AST) -> None:
        if isinstance(target, ast.Attribute):
            root, parts = _chain(target)
            if target.attr == "__class__":
                self._hit(target, "class swapped (__class__ =)")
            elif root in self.upstream:
                self._hit(target, f"{root}.{'.'.join(parts)} assigned")
        elif isinstance(target, (ast.Tuple, ast.List)):
            for element in target.elts:
                self._assigned(element)

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            self._assigned(target)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._assigned(node.target)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
        first = node.args[0] if node.args else None
        if name == "exec_module":
            self._hit(node, "module executed again (exec_module)")
        elif name in ("setattr", "object") and first is not None and _chain(first)[0] in self.upstream:
            self._hit(node, f"{name}(...) on {_chain(first)[0]}: monkeypatching")
        elif name == "import_module" and isinstance(first, ast.Constant) and isinstance(first.value, str):
            if _is_upstream(first.value) and any(_is_private(p) for p in first.value.split(".")):
                self._hit(node, f"import_module({first.value!r})")
        self.generic_visit(node)


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


@functools.lru_cache(maxsize=1)
def private_uses_outside_platform() -> tuple[tuple[str, int, str, str], ...]:
    """(file, line, function, what) of every private-API use outside platform/."""
    files = _sources()
    own_private = _defined_private_names(files)
    uses = []
    for path in files:
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith("platform/"):
            continue
        finder = _Finder(own_private)
        finder.visit(ast.parse(path.read_text()))
        uses += [(relative, line, function, what) for line, function, what in finder.found]
    return tuple(uses)


def test_private_torch_and_megatron_apis_are_used_in_platform_only():
    found = private_uses_outside_platform()
    assert not found, "private torch/megatron API outside megatron_ext/platform/ (move it there, with its versions):\n" + "\n".join(
        f"  megatron_ext/{file}:{line} ({function or 'module'}): {what}" for file, line, function, what in found
    )


def _finds(source: str) -> list[str]:
    finder = _Finder(own_private=set())
    finder.visit(ast.parse(source))
    return [what for _, _, what in finder.found]


@pytest.mark.parametrize(
    "source",
    [
        pytest.param("import torch.distributed as dist\nx = dist.distributed_c10d._world.pg_map", id="torch_world"),
        pytest.param("from torch.distributed import distributed_c10d as c\nc._update_default_pg(None)", id="c10d_setter"),
        pytest.param("from torch._C._distributed_c10d import FakeProcessGroup", id="private_module_import"),
        pytest.param("import importlib\nimportlib.import_module('torch._dynamo')", id="import_module_string"),
        pytest.param("from megatron.core import parallel_state\nx = parallel_state._global_process_group_list", id="megatron_global"),
        pytest.param("from megatron.core import parallel_state\nparallel_state.get_rank = len", id="monkeypatch"),
        pytest.param("from megatron.core import parallel_state\nsetattr(parallel_state, 'x', 1)", id="setattr"),
        pytest.param("import torch\nfrom unittest import mock\nmock.patch.object(torch.distributed, 'get_rank', f)", id="patch_object"),
        pytest.param("def f(m):\n    m.__class__ = type", id="class_swap"),
        pytest.param("def f(m):\n    return m._parameters", id="foreign_private_member"),
        pytest.param("def f(g):\n    return g.__code__", id="code_rebinding"),
        pytest.param("def f(spec, m):\n    spec.loader.exec_module(m)", id="exec_module"),
    ],
)
def test_the_search_finds_each_form(source):
    """Each form the rule forbids is found (the search itself can fail)."""
    assert _finds(source)


@pytest.mark.parametrize(
    "source",
    [
        pytest.param("import torch.distributed as dist\ndist.get_rank()", id="public_call"),
        pytest.param("class A:\n    def f(self):\n        return self._x", id="own_private"),
        pytest.param("from collections import namedtuple\np = namedtuple('P', 'a')(1)._replace(a=2)", id="namedtuple"),
        pytest.param("import torch\nx = torch.zeros(1)\nx.grad = None", id="tensor_attribute"),
    ],
)
def test_the_search_leaves_public_use_alone(source):
    assert not _finds(source)

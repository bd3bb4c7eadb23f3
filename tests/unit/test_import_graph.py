"""megatron_ext's modules depend on each other without cycles, counting every import.

The graph is read from the source with `ast`, so an import inside a function is an edge like one at
the top of a file: it is still a dependency, only a later one. Each `import a.b` is an edge to the
module `a.b`; each `from a import b` is an edge to the module `a.b` when there is one, else to `a`;
relative imports are resolved against the importing module's package. Names outside megatron_ext
are dropped. Imports under `if TYPE_CHECKING:` are left out: they never run, so they are no runtime
dependency (they only let a type checker see names used in annotations).

A cycle is a strongly connected component of two or more modules (Tarjan's algorithm); the test
fails naming the modules of each one.

The same graph keeps the layers running one way. Each module sits in one layer (`LAYERS`, lowest
first) and imports only from its own layer and those below:

    platform       upstream compatibility, device, launch; the package's own __init__ (version checks)
    config         schema, validation, Megatron-LM flags: no torch
    foundations    data, checkpointing (megatron's checkpoint format), parallel (the layout as a value)
    models         megatron-core models, pretrained weights, conversion
    training       training/, plugin.py (the protocol through which the Trainer calls plugins, so
                   below every plugin) and plugin_context.py (what its hooks receive), evaluation/ and
                   generation/ (the loss and the generation loop the Trainer and plugins call)
    plugins        reshard/, dpp/, elastic/, lora/: each imports none of the others
    entry points   train.py, pretrain_gpt.py, the evaluation and generation command lines

An import into a higher layer, or from one plugin into another, fails the test, named by its two
modules. Outside training/, `training/trainer.py` is imported for its Trainer class alone: the
helpers it keeps are its own, and what others share lives in the core's modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = "megatron_ext"
SOURCE_ROOT = Path(__file__).resolve().parents[2]


def module_files(root: Path) -> dict[str, Path]:
    """Every module of the package, by dotted name (a package by its own name, not `.__init__`)."""
    files = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        files[".".join(parts)] = path
    return files


def is_type_checking_block(node: ast.AST) -> bool:
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement at any depth, except the body of an `if TYPE_CHECKING:` block."""
    found: list[ast.Import | ast.ImportFrom] = []
    pending = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        children = node.orelse if is_type_checking_block(node) else ast.iter_child_nodes(node)
        pending.extend(children)
    return found


def imported_names(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The dotted names an import statement in `module` asks for, relative imports resolved."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        anchor = package[: len(package) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
    return [f"{base}.{alias.name}" for alias in node.names]


def target_module(name: str, modules: dict[str, Path]) -> str | None:
    """The module `name` lands on: itself if it is one, else its longest dotted prefix that is."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(root: Path) -> dict[str, set[str]]:
    """module -> the megatron_ext modules it imports anywhere in its source."""
    modules = module_files(root)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in runtime_imports(tree):
            for name in imported_names(node, module, path.name == "__init__.py"):
                target = target_module(name, modules)
                if target is not None and target != module:
                    graph[module].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of two or more nodes, largest first (Tarjan)."""
    index: dict[str, int] = {}
    lowlink: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = lowlink[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                visit(successor)
                lowlink[node] = min(lowlink[node], lowlink[successor])
            elif successor in on_stack:
                lowlink[node] = min(lowlink[node], index[successor])
        if lowlink[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(components, key=lambda c: (-len(c), c))


GRAPH_CASES = {
    "no cycle": ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
    "two-module cycle": ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
    "cycle through three, with a tail": (
        {"t": {"a"}, "a": {"b"}, "b": {"c"}, "c": {"a"}},
        [["a", "b", "c"]],
    ),
    "two separate cycles": (
        {"a": {"b"}, "b": {"a", "c"}, "c": {"d"}, "d": {"c"}},
        [["a", "b"], ["c", "d"]],
    ),
}


@pytest.mark.parametrize("graph, expected", GRAPH_CASES.values(), ids=GRAPH_CASES.keys())
def test_cycles_finds_each_strongly_connected_component(graph, expected):
    assert cycles(graph) == expected


def write_package(root: Path, files: dict[str, str]) -> None:
    for relative, text in files.items():
        path = root / PACKAGE / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


READING_CASES = {
    "import inside a function": (
        {"__init__.py": "", "a.py": "def f():\n    import megatron_ext.b\n", "b.py": ""},
        {"megatron_ext.a": {"megatron_ext.b"}},
    ),
    "relative from-import of a module": (
        {"__init__.py": "", "p/__init__.py": "", "p/a.py": "from . import b\n", "p/b.py": ""},
        {"megatron_ext.p.a": {"megatron_ext.p.b"}},
    ),
    "from-import of a name lands on its module": (
        {"__init__.py": "", "p/__init__.py": "", "p/a.py": "from ..q import X\n", "q.py": ""},
        {"megatron_ext.p.a": {"megatron_ext.q"}},
    ),
    "relative import in a package's __init__": (
        {"__init__.py": "", "p/__init__.py": "from .b import X\n", "p/b.py": ""},
        {"megatron_ext.p": {"megatron_ext.p.b"}},
    ),
    "TYPE_CHECKING block left out, its else kept": (
        {
            "__init__.py": "",
            "a.py": "import typing\nif typing.TYPE_CHECKING:\n    from . import b\nelse:\n    from . import c\n",
            "b.py": "",
            "c.py": "",
        },
        {"megatron_ext.a": {"megatron_ext.c"}},
    ),
    "outside names dropped": (
        {"__init__.py": "import torch\nfrom os import path\n"},
        {"megatron_ext": set()},
    ),
}


@pytest.mark.parametrize("files, expected", READING_CASES.values(), ids=READING_CASES.keys())
def test_import_graph_reads_every_runtime_import(tmp_path, files, expected):
    write_package(tmp_path, files)
    graph = import_graph(tmp_path)
    assert {module: graph[module] for module in expected} == expected


def test_megatron_ext_has_no_import_cycle():
    found = cycles(import_graph(SOURCE_ROOT))
    listing = "\n".join(f"  {len(c)} modules: {', '.join(c)}" for c in found)
    assert not found, f"{len(found)} import cycle(s), every import counted:\n{listing}"


# Lowest first: (layer, the modules in it: a package name stands for the package and every module
# under it, but `megatron_ext` for its own __init__ alone; the longest name that matches places a
# module). A module that none places fails the test, so a new package is given its layer.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("platform", ("megatron_ext", "megatron_ext.platform")),
    ("config", ("megatron_ext.config",)),
    ("foundations", ("megatron_ext.data", "megatron_ext.checkpointing", "megatron_ext.parallel")),
    ("models", ("megatron_ext.models",)),
    (
        "training",
        (
            "megatron_ext.training",
            "megatron_ext.plugin",
            "megatron_ext.plugin_context",
            "megatron_ext.evaluation",
            "megatron_ext.generation",
        ),
    ),
    ("plugins", ("megatron_ext.reshard", "megatron_ext.dpp", "megatron_ext.elastic", "megatron_ext.lora")),
    (
        "entry points",
        (
            "megatron_ext.train",
            "megatron_ext.pretrain_gpt",
            "megatron_ext.evaluation.cli",
            "megatron_ext.evaluation.__main__",
            "megatron_ext.generation.cli",
            "megatron_ext.generation.__main__",
        ),
    ),
)
# The layer whose packages are kept apart from each other, not only from the layers above.
SEPARATE = "plugins"


def placement(module: str, layers=LAYERS) -> tuple[int, str] | None:
    """(the index of `module`'s layer, the name in it that places the module), or None."""
    found = None
    for index, (_, names) in enumerate(layers):
        for name in names:
            inside = module == name or (module.startswith(name + ".") and name != PACKAGE)
            if inside and (found is None or len(name) > len(found[1])):
                found = (index, name)
    return found


def layer_breaks(graph: dict[str, set[str]], layers=LAYERS) -> list[str]:
    """Each import that runs into a higher layer, or from one package of the SEPARATE layer into
    another, as "importer -> imported (layer -> layer)"; a module with no layer is named too."""
    names = [name for name, _ in layers]
    found = [f"{m}: in no layer" for m in sorted(graph) if placement(m, layers) is None]
    for module in sorted(graph):
        here = placement(module, layers)
        for target in sorted(graph[module]):
            there = placement(target, layers)
            if here is None or there is None:
                continue
            upward = there[0] > here[0]
            sideways = there[0] == here[0] and names[here[0]] == SEPARATE and there[1] != here[1]
            if upward or sideways:
                found.append(f"{module} -> {target} ({names[here[0]]} -> {names[there[0]]})")
    return found


SMALL_LAYERS = (
    ("low", ("megatron_ext.low",)),
    ("plugins", ("megatron_ext.p", "megatron_ext.q")),
    ("top", ("megatron_ext.low.cli",)),
)
LAYER_CASES = {
    "downward and within a layer": (
        {
            "megatron_ext.p.a": {"megatron_ext.low.x", "megatron_ext.p.b"},
            "megatron_ext.low.x": set(),
            "megatron_ext.p.b": set(),
        },
        [],
    ),
    "upward": (
        {"megatron_ext.low.x": {"megatron_ext.p.a"}, "megatron_ext.p.a": set()},
        ["megatron_ext.low.x -> megatron_ext.p.a (low -> plugins)"],
    ),
    "a module placed above its package": (
        {"megatron_ext.low.x": {"megatron_ext.low.cli"}, "megatron_ext.low.cli": {"megatron_ext.low.x"}},
        ["megatron_ext.low.x -> megatron_ext.low.cli (low -> top)"],
    ),
    "one plugin into another": (
        {"megatron_ext.p.a": {"megatron_ext.q.b"}, "megatron_ext.q.b": set()},
        ["megatron_ext.p.a -> megatron_ext.q.b (plugins -> plugins)"],
    ),
    "a module in no layer": ({"megatron_ext.new.x": set()}, ["megatron_ext.new.x: in no layer"]),
}


@pytest.mark.parametrize("graph, expected", LAYER_CASES.values(), ids=LAYER_CASES.keys())
def test_layer_breaks_names_each_import_against_the_order(graph, expected):
    assert layer_breaks(graph, SMALL_LAYERS) == expected


def test_megatron_ext_layers_run_one_way():
    found = layer_breaks(import_graph(SOURCE_ROOT))
    listing = "\n".join(f"  {line}" for line in found)
    assert not found, f"{len(found)} import(s) against the layer order (see this file's docstring):\n{listing}"


TRAINER = f"{PACKAGE}.training.trainer"


def trainer_imports_outside_training(root: Path) -> list[str]:
    """Each import of training/trainer.py from outside training/ that takes more than the
    Trainer class (the module itself counts as more), as "module: what it takes"."""
    found = []
    for module, path in module_files(root).items():
        if module.startswith(f"{PACKAGE}.training.") or module == f"{PACKAGE}.training":
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in runtime_imports(tree):
            for name in imported_names(node, module, path.name == "__init__.py"):
                if name == TRAINER or (name.startswith(TRAINER + ".") and name != f"{TRAINER}.Trainer"):
                    found.append(f"{module}: {name}")
    return sorted(found)


def test_trainer_imports_outside_training_names_all_but_the_class(tmp_path):
    write_package(
        tmp_path,
        {
            "__init__.py": "",
            "training/__init__.py": "",
            "training/trainer.py": "",
            "training/step.py": "from megatron_ext.training.trainer import helper\n",
            "a.py": "from megatron_ext.training.trainer import Trainer, ddp_config\n",
            "b.py": "from megatron_ext.training import trainer\n",
            "c.py": "def f():\n    from megatron_ext.training.trainer import Trainer\n",
        },
    )
    assert trainer_imports_outside_training(tmp_path) == [
        "megatron_ext.a: megatron_ext.training.trainer.ddp_config",
        "megatron_ext.b: megatron_ext.training.trainer",
    ]


def test_only_the_trainer_class_is_taken_from_trainer_py():
    found = trainer_imports_outside_training(SOURCE_ROOT)
    assert not found, "outside training/, take only the Trainer class from trainer.py:\n" + "\n".join(found)

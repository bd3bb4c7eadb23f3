"""Plugin code reaches the running Trainer through the members of its PluginContext
(megatron_ext/plugin_context.py), never a private one: every hook of a plugin annotates its
context parameter `PluginContext`, and every read of such a parameter is a member of the
context; every `trainer.<member>` (a Trainer, or the context a hook passed on) is one of the
context's or one that code owning its run does with a Trainer it built (a runner, a tool); and
the Trainer has each of them, so the context and the Trainer keep one contract.
test_plugin_context.py checks at run time that the hooks receive the context."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import megatron_ext.plugin as plugin_module
from megatron_ext.plugin import Plugin
from megatron_ext.plugin_context import PluginContext

PACKAGE = Path(plugin_module.__file__).resolve().parent
TESTS = Path(__file__).resolve().parents[1]
# Where `trainer` names the core Trainer (lora's own modules name its packed trainer so).
PLUGIN_CODE = [*sorted((PACKAGE / "reshard").glob("*.py")), *sorted((PACKAGE / "dpp").rglob("*.py")),
               *sorted((PACKAGE / "elastic").glob("*.py")), PACKAGE / "lora" / "plugin.py",
               *sorted((TESTS / "plugins").rglob("*.py"))]
# What code that builds and drives a Trainer of its own (reshard's worker pool, dpp's tools)
# does with it besides the context's members: it owns that run. Its layout changes go through
# `layout_controller`, a member of the context.
RUN_OWNER_MEMBERS = {"setup", "train", "save", "close"}


def context_members() -> set[str]:
    return {n for n in dir(PluginContext) if not n.startswith("_")}


def member_reads(tree: ast.AST, name: str) -> set[tuple[str, int]]:
    """(member, line) of every `<name>.<member>` under `tree`."""
    return {
        (node.attr, node.lineno)
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == name
    }


def trainer_reads(path: Path) -> set[tuple[str, int]]:
    """Every `trainer.<member>` in the file."""
    return member_reads(ast.parse(path.read_text()), "trainer")


def context_reads(path: Path) -> set[tuple[str, int]]:
    """Every read of a member of a parameter annotated `PluginContext`, in its function (nested
    functions included). By annotation, not by name: `ctx` also names autograd's contexts."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for arg in node.args.args + node.args.kwonlyargs:
                if arg.annotation is not None and ast.unparse(arg.annotation).split(".")[-1] == "PluginContext":
                    found |= member_reads(node, arg.arg)
    return found


def context_positions() -> dict[str, int]:
    """Each hook of the protocol that takes the context -> the position of that parameter."""
    found = {}
    for name, hook in vars(Plugin).items():
        if inspect.isfunction(hook):
            params = [p.annotation for p in inspect.signature(hook).parameters.values()]
            if "PluginContext" in params:
                found[name] = params.index("PluginContext")
    return found


def unannotated_hooks(path: Path) -> list[str]:
    """`Class.hook` for each hook a Plugin subclass in the file defines without annotating its
    context parameter `PluginContext` (then context_reads would not see its reads)."""
    positions, found = context_positions(), []
    for cls in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(cls, ast.ClassDef) and any(ast.unparse(b).endswith("Plugin") for b in cls.bases)):
            continue
        for method in cls.body:
            if isinstance(method, ast.FunctionDef) and method.name in positions:
                arg = method.args.args[positions[method.name]]
                if arg.annotation is None or ast.unparse(arg.annotation).split(".")[-1] != "PluginContext":
                    found.append(f"{path.relative_to(PACKAGE.parent)}: {cls.name}.{method.name}")
    return found


def outside(scan, allowed: set[str]) -> list[str]:
    return [f"{path.relative_to(PACKAGE.parent)}:{line}: .{member}"
            for path in PLUGIN_CODE for member, line in sorted(scan(path)) if member not in allowed]


def real_trainer_members() -> set[str]:
    from megatron_ext.training import trainer

    tree = ast.parse(Path(trainer.__file__).read_text())
    targets = [t for node in ast.walk(tree) if isinstance(node, ast.Assign) for t in node.targets]
    targets += [node.target for node in ast.walk(tree) if isinstance(node, ast.AnnAssign)]
    targets += [e for t in targets if isinstance(t, ast.Tuple) for e in t.elts]
    assigned = {
        t.attr for t in targets if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
    }
    return assigned | {n for n in dir(trainer.Trainer) if not n.startswith("_")}


def test_every_hook_annotates_its_context():
    assert len(context_positions()) == 7  # setup, layer_spec, ..., on_train_end
    found = [hook for path in PLUGIN_CODE for hook in unannotated_hooks(path)]
    assert not found, "annotate the hook's context parameter `PluginContext`:\n" + "\n".join(found)


def test_plugin_code_reads_the_context_through_its_members_only():
    found = outside(context_reads, context_members())
    assert not found, "add the member to PluginContext (a public one of the Trainer), or use one it has:\n" + "\n".join(found)


def test_plugin_code_reads_a_trainer_through_the_context_members_or_as_the_owner_of_its_run():
    found = outside(trainer_reads, context_members() | RUN_OWNER_MEMBERS)
    assert not found, "use the context's members (PluginContext), or a Trainer this code built and runs:\n" + "\n".join(found)


def test_the_trainer_has_every_member_plugins_use():
    assert context_members() | RUN_OWNER_MEMBERS <= real_trainer_members()


def test_the_scan_sees_reads():
    # Not vacuous: the plugins do read the context, through several members, and files that
    # own a run read their Trainer.
    assert len({member for path in PLUGIN_CODE for member, _ in context_reads(path)}) >= 10
    assert {member for path in PLUGIN_CODE for member, _ in trainer_reads(path)} & RUN_OWNER_MEMBERS

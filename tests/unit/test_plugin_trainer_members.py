"""Plugins use the Trainer through the members `megatron_ext.plugin.Trainer` lists, and the
Trainer has each of them: a plugin never reads a private member, and the list is the contract a
change to the Trainer must keep."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import megatron_ext.plugin as plugin_module
from megatron_ext.plugin import Trainer as TrainerProtocol

PACKAGE = Path(plugin_module.__file__).resolve().parent
# Where `trainer` names the core Trainer (lora's own modules name its packed trainer so).
PLUGIN_CODE = [*sorted((PACKAGE / "reshard").glob("*.py")), *sorted((PACKAGE / "dpp").rglob("*.py")),
               *sorted((PACKAGE / "elastic").glob("*.py")), PACKAGE / "lora" / "plugin.py"]


def protocol_members() -> set[str]:
    methods = {n for n, v in vars(TrainerProtocol).items() if inspect.isfunction(v) and not n.startswith("_")}
    return methods | set(TrainerProtocol.__annotations__)


def trainer_reads(path: Path) -> set[tuple[str, int]]:
    """(member, line) of every `trainer.<member>` in the file."""
    return {
        (node.attr, node.lineno)
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "trainer"
    }


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


def test_plugins_read_only_the_trainer_members_of_the_protocol():
    allowed = protocol_members()
    outside = [f"{path.relative_to(PACKAGE)}:{line}: trainer.{name}"
               for path in PLUGIN_CODE for name, line in sorted(trainer_reads(path)) if name not in allowed]
    assert not outside, "add the member to megatron_ext.plugin.Trainer (public ones only), or use one listed:\n" + "\n".join(outside)


def test_the_trainer_has_every_member_of_the_protocol():
    assert protocol_members() - real_trainer_members() == set()


def test_the_scan_sees_reads():
    # Not vacuous: the plugins do read the Trainer, through several members.
    assert len({name for path in PLUGIN_CODE for name, _ in trainer_reads(path)}) >= 10

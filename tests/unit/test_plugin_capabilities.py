"""Which plugins run together follows from what each declares it does (config/capabilities.py):
every rule of the conflict table refuses its pair naming both plugins, plugins whose
capabilities meet no rule compose, a hook declares the capability it implies, and no plugin
names another. A plugin of its own folder (tests/plugins/step_clock/) that runs the step is
refused beside dpp before launch, and composes with reshard."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_ext.config.capabilities import CONFLICTS, Capability, refusals
from megatron_ext.config.plugin_sections import BUILTIN, PluginSection, builtin_sections, plugin_sections
from megatron_ext.config.schema import Config
from megatron_ext.config.validate import ConfigError
from megatron_ext.plugin import Plugin, hook_capabilities, register_plugin, registered_plugins
from tests.unit._outside_plugin_runs import train_with_plugin

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("rule", CONFLICTS, ids=[f"{c.first.name}-{c.second.name if c.second else 'any'}" for c in CONFLICTS])
def test_each_rule_refuses_its_pair_in_either_order(rule):
    first = ("a", frozenset({rule.first}))
    second = ("b", frozenset({rule.second} if rule.second else ()))
    assert refusals([first, second]) == [rule.reason.format(first="a", second="b")]
    # A rule between two plugins of one capability names them in the run's order.
    names = ("b", "a") if rule.first == rule.second else ("a", "b")
    assert refusals([second, first]) == [rule.reason.format(first=names[0], second=names[1])]


def test_a_pair_is_refused_once_by_the_first_rule_it_meets():
    loop = frozenset({Capability.REPLACES_TRAINER_LOOP, Capability.OWNS_RUN})
    found = refusals([("pool", frozenset({Capability.OWNS_RUN})), ("sweep", loop)])
    assert found == ["sweep trains in a loop of its own, not the Trainer's: pool's hooks would be ignored; "
                     "run pool without sweep"]


def test_capabilities_that_meet_no_rule_compose():
    assert refusals([("a", frozenset(Capability) - {Capability.REPLACES_TRAINER_LOOP, Capability.OWNS_STEP,
                                                    Capability.OWNS_RUN, Capability.CHANGES_LAYOUT}),
                     ("b", frozenset({Capability.OWNS_STEP, Capability.REWRITES_LAYER_SPECS})), ("c", frozenset())]) == []


# The builtin plugins' pairs, as their declared capabilities make them: refused (a phrase of the
# reason) or composing (None).
BUILTIN_PAIRS = {
    ("reshard", "dpp"): None,
    ("dpp", "elastic"): "dpp and elastic each run the training step",
    ("reshard", "elastic"): "elastic with reshard is not supported",
    ("lora", "reshard"): "lora trains in a loop of its own, not the Trainer's: reshard's hooks would be ignored",
    ("lora", "dpp"): "dpp's hooks would be ignored",
    ("lora", "elastic"): "elastic's hooks would be ignored",
}


@pytest.mark.parametrize("pair", BUILTIN_PAIRS, ids="+".join)
def test_builtin_plugins_compose_as_their_capabilities_say(pair):
    sections = builtin_sections()
    found = refusals((name, sections[name].capabilities) for name in pair)
    phrase = BUILTIN_PAIRS[pair]
    assert (found == []) if phrase is None else (len(found) == 1 and phrase in found[0]), found


def test_a_hook_declares_the_capability_it_implies():
    class Specs(Plugin):
        name = "specs"
        capabilities = frozenset({Capability.CHANGES_LOSS})

        def layer_spec(self, spec, ctx):
            return spec

    assert Specs.capabilities == {Capability.CHANGES_LOSS, Capability.REWRITES_LAYER_SPECS}


def test_a_section_that_leaves_out_what_a_hook_implies_is_refused_at_registration():
    class Undeclared(Plugin):
        section = PluginSection("undeclared", capabilities=frozenset({Capability.OWNS_STEP}))

        def after_model_built(self, model_chunks, ctx):
            return model_chunks

    with pytest.raises(ValueError, match=r"plugin 'undeclared' overrides after_model_built \(EDITS_BUILT_MODEL\) but "
                                         r"its section does not declare Capability.EDITS_BUILT_MODEL"):
        register_plugin(Undeclared)
    assert "undeclared" not in plugin_sections()


def test_every_builtin_plugin_declares_what_its_hooks_imply():
    for name in BUILTIN:
        cls = registered_plugins()[name]
        assert hook_capabilities(cls) <= cls.capabilities == builtin_sections()[name].capabilities, name


def test_the_trainer_refuses_plugins_that_conflict_before_it_starts():
    from megatron_ext.training.trainer import Trainer

    class Steps(Plugin):
        def forward_backward_func(self, ctx):
            return None

    one, other = type("One", (Steps,), {"name": "one"}), type("Other", (Steps,), {"name": "other"})
    with pytest.raises(ConfigError, match="plugins: one and other each run the training step"):
        Trainer(Config(), [one(), other()])  # no torch world exists: refused before it is needed


def test_a_layout_moves_prebuilt_unless_a_plugin_rewrites_the_model():
    from megatron_ext.training.layout_controller import LayoutController

    class Hooks(Plugin):
        def on_step_end(self, ctx, step, metrics):
            pass

    class Edits(Plugin):
        capabilities = frozenset({Capability.EDITS_BUILT_MODEL})

    def can_prepare_ahead(*plugins: Plugin) -> bool:
        return LayoutController(SimpleNamespace(plugins=list(plugins), layout=None)).can_prepare_ahead

    assert can_prepare_ahead(Hooks())
    assert not can_prepare_ahead(Hooks(), Edits())


def _names_in(path: Path) -> set[str]:
    """The string constants of a module's code (docstrings and comments are not code)."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)}
    return {node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings}


def test_no_plugin_names_another():
    for name in BUILTIN:
        for path in sorted((REPO / "megatron_ext" / name).rglob("*.py")):
            others = _names_in(path) & (set(BUILTIN) - {name})
            assert not others, f"{path.relative_to(REPO)} names {sorted(others)}"


@pytest.mark.parametrize("core", ["config", "training", "platform", "models", "parallel", "data", "checkpointing"])
def test_the_core_names_no_plugin(core):
    allowed = {REPO / "megatron_ext/config/plugin_sections.py"}  # BUILTIN: where the builtin sections are
    for path in sorted((REPO / "megatron_ext" / core).rglob("*.py")):
        if path not in allowed:
            assert not _names_in(path) & set(BUILTIN), f"{path.relative_to(REPO)} names a plugin"


def train(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    return train_with_plugin("tests.plugins.step_clock", tmp_path, *overrides)


def test_an_outside_plugin_that_runs_the_step_is_refused_beside_dpp_before_launch(tmp_path):
    save = tmp_path / "checkpoints"
    done = train(tmp_path, "plugins=[step_clock,dpp]", "launcher.nproc=2", "parallel.pp=2", f"checkpoint.save={save}")
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (
        "error: plugins: step_clock and dpp each run the training step (forward_backward_func): the Trainer runs "
        "one, the other's would be ignored; a run can use one of them")
    assert not save.exists()  # refused before any worker started or wrote


def test_an_outside_plugin_composes_with_a_plugin_it_does_not_conflict_with(tmp_path):
    done = train(tmp_path, "plugins=[reshard,step_clock]", "launcher.nproc=1", "train.iters=2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step 2: forward-backward" in done.stdout + done.stderr

"""The generated reference pages are current (the Megatron-LM flag table is checked in
tests/unit/test_mlm_args.py)."""

from __future__ import annotations

from megatron_ext.config.reference import PAGE, field_comments, reference_markdown
from megatron_ext.config.schema import LauncherConfig
from tests.docs._markdown import REPO


def test_config_reference_is_current():
    assert (REPO / PAGE).read_text() == reference_markdown(), (
        f"{PAGE} is stale: python -m megatron_ext.config.reference"
    )


def test_field_comments_are_read_from_the_source():
    comments = field_comments(LauncherConfig)
    assert comments["master_port"] == "0: pick a free port."
    assert comments["nproc"].startswith("Local worker processes to start")
    assert comments["master_addr"] == ""


def test_every_plugin_section_is_in_the_reference():
    from megatron_ext.plugin import registered_plugins

    text = reference_markdown()
    for name, plugin in registered_plugins().items():
        if plugin.config_class is not None:
            assert f"## `{name}`" in text

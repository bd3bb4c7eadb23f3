"""The generated reference pages are current (the Megatron-LM flag table is checked in
tests/unit/test_mlm_args.py)."""

from __future__ import annotations

import dataclasses
import re

from megatron_ext.config.reference import PAGE, field_comments, reference_markdown, section_table
from megatron_ext.config.schema import LauncherConfig
from tests.docs._markdown import REPO


def test_config_reference_is_current():
    assert (REPO / PAGE).read_text() == reference_markdown(), (
        f"{PAGE} is stale: python -m megatron_ext.config.reference"
    )


def test_plugin_tables_are_current():
    from megatron_ext.config.plugin_tables import PAGE as TABLES_PAGE, builtin_tables, page_with_tables

    page = (REPO / TABLES_PAGE).read_text()
    assert page == page_with_tables(page, builtin_tables()), f"{TABLES_PAGE} is stale: python -m megatron_ext.config.plugin_tables"


def test_field_comments_are_read_from_the_source():
    comments = field_comments(LauncherConfig)
    assert comments["master_port"] == "0: pick a free port."
    assert comments["nproc"].startswith("Local worker processes to start")
    assert comments["master_addr"] == "Address of rank 0's rendezvous for local workers."


def test_every_plugin_section_is_in_the_reference():
    from megatron_ext.plugin import registered_plugins

    text = reference_markdown()
    for name, plugin in registered_plugins().items():
        if plugin.config_class is not None:
            assert f"## `{name}`" in text


def fields_without_meaning(page: str) -> list[str]:
    """The keys of the reference's rows whose meaning cell is empty."""
    return [m.group(1) for m in re.finditer(r"^\| `([^`]+)` \|.*\| *\|$", page, re.M)]


def test_every_config_field_has_a_meaning():
    missing = fields_without_meaning(reference_markdown())
    assert not missing, f"fields without a comment in their config class: {missing}"


def test_a_field_without_a_comment_is_found():
    @dataclasses.dataclass
    class Section:
        # Commented.
        a: int = 1
        b: int = 2

    assert fields_without_meaning(section_table("x", Section)) == ["x.b"]

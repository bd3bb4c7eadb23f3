"""An import inside a function says why it is there.

megatron_ext imports at the top of a module, except where an import inside a function keeps an
optional dependency (`# optional: <package>`) or a heavy one (`# torch: ...`, `# heavy: ...`) off
an entry path that must stay light: the config, and the refusal of a bad command line, load no
torch (tests/unit/test_config_without_torch.py). Such an import carries a comment on its line or
on the line directly above; a comment above a function's block of imports covers the block
(consecutive import lines, or groups of them parted by one blank line, as isort parts them). The import graph has no cycle (tests/unit/test_import_graph.py), so no import needs to
stay in a function to break one.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "megatron_ext"
SOURCE_ROOT = Path(__file__).resolve().parents[2]


def in_function_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement nested in a function, at any depth below it."""
    found: list[ast.Import | ast.ImportFrom] = []
    pending: list[tuple[ast.AST, bool]] = [(tree, False)]
    while pending:
        node, in_function = pending.pop()
        if in_function and isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        inside = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        pending.extend((child, inside) for child in ast.iter_child_nodes(node))
    return sorted(found, key=lambda node: node.lineno)


def has_comment(line: str) -> bool:
    """Whether a source line holds a comment (a `#` outside a string, as the tokenizer sees it)."""
    code = line.split("#", 1)[0]
    return "#" in line and code.count('"') % 2 == 0 and code.count("'") % 2 == 0


def uncommented(source: str) -> list[int]:
    """The first lines of the in-function imports of `source` that no comment explains."""
    lines = source.splitlines()
    covered_ends: set[int] = set()
    missing = []
    for node in in_function_imports(ast.parse(source)):
        above = lines[node.lineno - 2] if node.lineno > 1 else ""
        in_block = node.lineno - 1 in covered_ends or (node.lineno - 2 in covered_ends and not above.strip())
        if has_comment(lines[node.lineno - 1]) or above.lstrip().startswith("#") or in_block:
            covered_ends.add(node.end_lineno)
        else:
            missing.append(node.lineno)
    return missing


def checked_files() -> list[Path]:
    return sorted((SOURCE_ROOT / PACKAGE).rglob("*.py"))


def test_every_in_function_import_says_why():
    missing = [
        f"{path.relative_to(SOURCE_ROOT)}:{line}"
        for path in checked_files()
        for line in uncommented(path.read_text())
    ]
    assert missing == [], f"imports inside functions without a comment saying why: {missing}"


# source -> the lines the check reports
CASES = {
    "top_level": ("import os\n", []),
    "bare": ("def f():\n    import torch\n", [2]),
    "same_line": ("def f():\n    import torch  # torch: off the refusal path\n", []),
    "line_above": ("def f():\n    # optional: wandb\n    import wandb\n", []),
    "block_under_a_comment": ("def f():\n    # heavy: megatron\n    import a\n    from b import c\n", []),
    "isort_groups_share_the_comment": ("def f():\n    import a  # heavy: a\n\n    import b\n", []),
    "code_ends_the_block": ("def f():\n    import a  # heavy: a\n    x = 1\n    import b\n", [4]),
    "two_blank_lines_end_the_block": ("def f():\n    import a  # heavy: a\n\n\n    import b\n", [5]),
    "hash_in_a_string": ("def f():\n    x = '#'\n    import b\n", [3]),
    "nested_function": ("class A:\n    def f(self):\n        def g():\n            import a\n", [4]),
}


def test_the_check_on_named_cases():
    found = {name: uncommented(source) for name, (source, _) in CASES.items()}
    assert found == {name: lines for name, (_, lines) in CASES.items()}

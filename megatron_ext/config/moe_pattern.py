"""Which layers of a GPT hold experts: `model.moe_layer_freq`, read as megatron reads it. The
config's rules read it before anything starts; the model builder gives it to megatron.
"""

from __future__ import annotations

import ast

from megatron_ext.config.schema import ModelConfig


def moe_layer_pattern(model: ModelConfig) -> list[int]:
    """model.moe_layer_freq as one 0 (dense) / 1 (MoE) per layer: an integer N puts MoE in
    every N-th layer from the first; a string is megatron's Python list expression of 0s and 1s
    ("([0]+[1]*3)*2"), read without executing anything but list arithmetic."""
    text = str(model.moe_layer_freq).strip()
    if text.isdigit():
        freq = int(text)
        return [int(i % freq == 0) for i in range(model.num_layers)] if freq else []
    return pattern_expression(text)


def pattern_expression(text: str) -> list[int]:
    """Megatron's list expression of 0s and 1s ("([0]+[1]*3)*2") as the list it makes."""
    return _list_expression(ast.parse(text, mode="eval").body)


def _list_expression(node: ast.AST):
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.List):
        return [_list_expression(e) for e in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _list_expression(node.left), _list_expression(node.right)
        return left + right if isinstance(node.op, ast.Add) else left * right
    raise ValueError(f"not a list expression of 0s and 1s: {ast.unparse(node)!r}")

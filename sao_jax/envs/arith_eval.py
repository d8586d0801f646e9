"""A tiny, safe integer-arithmetic evaluator (the "Python tool" of the demo).

``safe_eval_arith("347*29-118") == 9945``.  Only integer literals, the binary
operators ``+ - * //``, unary minus and parentheses are accepted; everything
else (names, calls, attributes, ``**``, ``/``, floats, strings, ...) raises
``ValueError``.  The expression is parsed with ``ast`` and walked by hand —
no ``eval``/``exec``.

Bounds (all violations raise ``ValueError``):

* ``len(expr) <= MAX_EXPR_CHARS`` (64),
* every literal and every intermediate value satisfies ``|v| <= MAX_ABS_VALUE``
  (10**12),
* division by zero.

``//`` is Python floor division (rounds toward -inf: ``-7//2 == -4``).
"""

from __future__ import annotations

import ast
import operator

MAX_EXPR_CHARS = 64
MAX_ABS_VALUE = 10**12

_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
}


def _check(v: int) -> int:
  if abs(v) > MAX_ABS_VALUE:
    raise ValueError(f"value out of range (|v| > {MAX_ABS_VALUE})")
  return v


def _eval(node: ast.AST) -> int:
  if isinstance(node, ast.Constant):
    if type(node.value) is not int:  # rejects bool, float, str, complex, ...
      raise ValueError(f"only integer literals are allowed, got {node.value!r}")
    return _check(node.value)
  if isinstance(node, ast.UnaryOp):
    if not isinstance(node.op, ast.USub):
      raise ValueError(f"unary operator {type(node.op).__name__} not allowed")
    return _check(-_eval(node.operand))
  if isinstance(node, ast.BinOp):
    op = _BINOPS.get(type(node.op))
    if op is None:
      raise ValueError(f"operator {type(node.op).__name__} not allowed")
    left = _eval(node.left)
    right = _eval(node.right)
    if op is operator.floordiv and right == 0:
      raise ValueError("division by zero")
    return _check(op(left, right))
  raise ValueError(f"{type(node).__name__} not allowed")


def safe_eval_arith(expr: str) -> int:
  """Evaluate an integer arithmetic expression; ``ValueError`` on anything else."""
  if not isinstance(expr, str):
    raise ValueError(f"expression must be a str, got {type(expr).__name__}")
  if len(expr) > MAX_EXPR_CHARS:
    raise ValueError(f"expression longer than {MAX_EXPR_CHARS} characters")
  if not expr.strip():
    raise ValueError("empty expression")
  try:
    tree = ast.parse(expr.strip(), mode="eval")
  except (SyntaxError, ValueError, MemoryError, RecursionError) as e:
    raise ValueError(f"invalid expression: {e}") from None
  try:
    return _eval(tree.body)
  except RecursionError:
    raise ValueError("expression nested too deeply") from None

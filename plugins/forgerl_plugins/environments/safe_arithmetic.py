"""Arithmetic on model-written text without running it: the expression is parsed with
:mod:`ast` (a parser, no evaluation) and only number literals, + - * / ** and parentheses
are computed, by this module, with bounds on size. ``eval`` never sees the text."""

from __future__ import annotations

import ast
import math
import operator
from fractions import Fraction

#: Characters of an expression: a bound on parse depth and work.
MAX_CHARS = 200
#: Largest exponent of ``**`` (2**64 is fine; 9**9**9 is refused before it is computed).
MAX_EXPONENT = 64
#: Digits of any intermediate result.
MAX_DIGITS = 60

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


class ExpressionError(ValueError):
    """The expression is not plain arithmetic, or is too large."""


def evaluate(expression: str) -> Fraction:
    """The exact value of ``expression`` (integers and decimals, + - * / ** and parentheses)."""
    if not isinstance(expression, str):
        raise ExpressionError("the expression must be a string")
    if len(expression) > MAX_CHARS:
        raise ExpressionError(f"expression too long ({len(expression)} characters, at most {MAX_CHARS})")
    try:
        tree = ast.parse(expression.replace("^", "**"), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise ExpressionError(f"not an arithmetic expression: {type(exc).__name__}") from None
    return _value(tree.body)


def _check(x: Fraction) -> Fraction:
    if max(abs(x.numerator), x.denominator).bit_length() > MAX_DIGITS * 3.33:
        raise ExpressionError(f"a result has more than {MAX_DIGITS} digits")
    return x


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        number = node.value
        assert isinstance(number, (int, float)), "checked just above"
        if isinstance(number, float) and not math.isfinite(number):
            raise ExpressionError("numbers must be finite")
        return _check(Fraction(number))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        inner = _value(node.operand)
        return -inner if isinstance(node.op, ast.USub) else inner
    if isinstance(node, ast.BinOp):
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow):
            if right.denominator != 1 or abs(right) > MAX_EXPONENT:
                raise ExpressionError(f"exponents must be whole numbers of at most {MAX_EXPONENT}")
            if left == 0 and right < 0:
                raise ExpressionError("division by zero")
            return _check(left ** int(right))
        op = _BINARY.get(type(node.op))
        if op is None:
            raise ExpressionError(f"operator {type(node.op).__name__} is not allowed (only + - * / **)")
        if op is operator.truediv and right == 0:
            raise ExpressionError("division by zero")
        return _check(op(left, right))
    raise ExpressionError(f"{type(node).__name__} is not allowed: only numbers, + - * / ** and parentheses")


def format_value(x: Fraction) -> str:
    """An integer as itself, anything else as a decimal."""
    if x.denominator == 1:
        return str(x.numerator)
    return f"{float(x):.10g}"

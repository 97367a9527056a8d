"""Static safety check for regular expressions that run on untrusted prompt text.

Python's ``re`` backtracks and has no timeout, and canonicalization runs on the gateway's event loop,
so a tenant's pattern is judged on its parsed form before it is ever run. The limits keep a search
within a bounded amount of work per starting position (measured: ≲0.3 s per 100k adversarial
characters at the default budget).
"""

from __future__ import annotations

import re._constants as _sre  # the parser's opcodes; stable across 3.11–3.13
import re._parser as _sre_parse  # private, but the only way to inspect a pattern without running it
from collections.abc import Sequence

MAX_MATCH_CHARS = 256  # longest text one match (and one lookaround) may cover
MAX_REPEAT_BOUND = 64  # largest upper bound of a repeat ({m,n} with n ≤ 64)
MAX_BACKTRACK_PRODUCT = 256  # bound on paths tried per start position


def check_pattern_safety(source: str, *, max_cost: int = MAX_BACKTRACK_PRODUCT) -> str | None:
    """Why ``source`` is unsafe to run on untrusted text, or None if it is acceptable.

    Every repeat is bounded (``{m,n}``, n ≤ ``MAX_REPEAT_BOUND``; no ``*``, ``+``, ``{m,}``), so a
    search costs at most a bounded amount per starting position; a repeat that may iterate holds only
    fixed-width bodies without alternation (``(a|ab){1,9}``, ``(x{1,3}){1,9}`` are the exponential
    shapes) unless the body is atomic or the repeat possessive; the product of repeat ranges along a
    path stays under ``max_cost``; no back-references; no empty matches; a match is
    at most ``MAX_MATCH_CHARS`` long.
    """
    tree = _sre_parse.parse(source)
    try:
        cost = _path_cost(tree, max_cost)
    except _UnsafePattern as exc:
        return str(exc)
    if cost > max_cost:
        return f"too many ambiguous repeats in a row (backtracking bound {cost} > {max_cost})"
    low, high = tree.getwidth()
    if low == 0:
        return "it can match empty text"
    if high > MAX_MATCH_CHARS:
        return f"it can match more than {MAX_MATCH_CHARS} characters"
    return None


class _UnsafePattern(Exception):
    pass


_REPEATS = (_sre.MAX_REPEAT, _sre.MIN_REPEAT, _sre.POSSESSIVE_REPEAT)


def _path_cost(items: Sequence, max_cost: int) -> int:
    """Bound on the paths a match attempt may try from one position; raises _UnsafePattern on an
    unsafe shape.

    A repeat multiplies by its range; an alternation of fixed-width branches (``0[1-9]|1[0-2]``)
    fails or succeeds within its width and multiplies by its costliest branch, other alternations by
    the sum of their branches. Lookarounds and atomic groups never backtrack into their body once
    done, so their bodies are checked as separate scopes and count 1 for the enclosing path.
    """
    cost = 1
    for op, av in items:
        if op in _REPEATS:
            low, high, body = av
            if high == _sre.MAXREPEAT or high > MAX_REPEAT_BOUND:
                raise _UnsafePattern(f"unbounded repeat; write {{m,n}} with n ≤ {MAX_REPEAT_BOUND}")
            if op == _sre.POSSESSIVE_REPEAT:
                _check_scope(body, max_cost)
                continue
            width_low, width_high = body.getwidth()
            if high > 1 and not _is_atomic(body) and (width_low != width_high or _has_branch(body)):
                raise _UnsafePattern(
                    "a repeat over a variable-width or alternating body (nested quantifiers); "
                    "make the body atomic (?>…) or the repeat possessive"
                )
            cost *= (high - low + 1) * _path_cost(body, max_cost)
        elif op == _sre.SUBPATTERN:
            cost *= _path_cost(av[3], max_cost)
        elif op == _sre.BRANCH:
            costs = [_path_cost(branch, max_cost) for branch in av[1]]
            fixed = all(branch.getwidth()[0] == branch.getwidth()[1] for branch in av[1])
            cost *= max(costs) if fixed else sum(costs)
        elif op == _sre.ATOMIC_GROUP:
            _check_scope(av, max_cost)
        elif op in (_sre.ASSERT, _sre.ASSERT_NOT):
            _check_scope(av[1], max_cost)
        elif op in (_sre.GROUPREF, _sre.GROUPREF_EXISTS):
            raise _UnsafePattern("back-references and conditionals are not allowed")
    return cost


def _check_scope(items: Sequence, max_cost: int) -> None:
    if _path_cost(items, max_cost) > max_cost:
        raise _UnsafePattern("a lookaround, atomic group or possessive repeat is too ambiguous")
    if items.getwidth()[1] > MAX_MATCH_CHARS:
        raise _UnsafePattern(
            f"a lookaround, atomic group or possessive repeat spans over {MAX_MATCH_CHARS} chars"
        )


def _is_atomic(items: Sequence) -> bool:
    if len(items) != 1:
        return False
    op, av = items[0]
    return op == _sre.ATOMIC_GROUP or (op == _sre.SUBPATTERN and _is_atomic(av[3]))


def _has_branch(items: Sequence) -> bool:
    for op, av in items:
        if op == _sre.BRANCH:
            return True
        if op == _sre.SUBPATTERN and _has_branch(av[3]):
            return True
        if op in _REPEATS and _has_branch(av[2]):
            return True
    return False

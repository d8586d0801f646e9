"""Procedurally generated modules for ``swe_lite`` (``task.swe_generated``): the hand-written
62 of ``swe_lite_modules`` are too few for a small model to learn a fix that carries over to
modules it has not seen (it memorises the training modules; docs/coding.md, "Does it learn?").

``generate(n)`` returns ``n`` modules in the format of ``swe_lite_modules.MODULES``: ``(name,
source, cases)``, one function named like the module, 5 ``(call, expected)`` cases whose
expected values come from running the source here (the package's own templates, never the
policy's code). Each module is one of ``TEMPLATES`` (threshold branches, clamps, counts and sums
over a list, a range sum, comparisons of two arguments, a guarded expression) with its names,
constants and operators drawn at random, and test inputs drawn around its constants so that a
changed comparison or operator changes some case. Deterministic in ``seed``; no ``while`` loops
(a mutant cannot loop forever); the train / eval split stays ``swe_lite.split_of`` (by module
name), so a held-out module is a new draw of a template the training modules share, not a new
kind of code.
"""

from __future__ import annotations

import numpy as np

__all__ = ["TEMPLATES", "generate"]

_VERBS = ("count", "score", "pick", "rate", "step", "scale", "bound", "check", "total", "limit",
          "shift", "grade", "rank", "tally", "trim", "weigh", "cap", "sort", "mark", "test")
_NOUNS = ("items", "value", "pair", "level", "points", "span", "steps", "cost", "size", "marks",
          "load", "price", "ticks", "bonus", "depth", "speed", "stock", "votes", "hits", "bins")
_SCALAR = ("x", "n", "v", "k", "m", "a", "t", "q")
_LISTS = ("xs", "vals", "nums", "items", "data")
_ACC = ("total", "acc", "out", "s", "res")
_CMPS = ("<", "<=", ">", ">=")
_AOPS = ("+", "-", "*")


def _pick(r: np.random.Generator, seq, k: int = 1):
  out = [seq[i] for i in r.choice(len(seq), size=k, replace=False)]
  return out[0] if k == 1 else out


def _near(r, c: int, k: int, lo: int = -3, hi: int = 3) -> list[int]:
  """``k`` distinct ints around ``c``, ``c`` itself first (the boundary case)."""
  pool = [c + d for d in range(lo, hi + 1) if d != 0]
  return [c] + [int(v) for v in r.choice(pool, size=k - 1, replace=False)]


def _threshold(r, f):
  x, (c1, c2, c3) = _pick(r, _SCALAR), r.integers(0, 10, size=3)
  src = (f"def {f}({x}):\n  if {x} {_pick(r, _CMPS)} {c1}:\n    return {x} {_pick(r, _AOPS)} {c2}"
         f"\n  return {c3}\n")
  return src, [f"({v})" for v in _near(r, int(c1), 5)]


def _two_branch(r, f):
  x = _pick(r, _SCALAR)
  c1, c3 = sorted(int(v) for v in r.choice(10, size=2, replace=False))
  c2, c4 = r.integers(0, 10, size=2)
  src = (f"def {f}({x}):\n  if {x} {_pick(r, ('<', '<='))} {c1}:\n    return {c2}\n"
         f"  if {x} {_pick(r, ('>', '>='))} {c3}:\n    return {c4}\n  return {x}\n")
  return src, [f"({v})" for v in (c1, c3, c1 - 1, c3 + 1, c3 + 5)]


def _clamp(r, f):
  x, lo, hi = _pick(r, _SCALAR, 3)
  a, b = sorted(int(v) for v in r.choice(12, size=2, replace=False))
  src = (f"def {f}({x}, {lo}, {hi}):\n  if {x} {_pick(r, ('<', '<='))} {lo}:\n    return {lo}\n"
         f"  if {x} {_pick(r, ('>', '>='))} {hi}:\n    return {hi}\n  return {x}\n")
  return src, [f"({v}, {a}, {b})" for v in (a, b, a - 1, b + 1, (a + b) // 2)]


def _lists(r, c: int, k: int = 5) -> list[str]:
  out = []
  for _ in range(k):
    n = int(r.integers(1, 5))
    out.append("([" + ", ".join(str(int(v)) for v in r.integers(c - 3, c + 4, size=n)) + "])")
  out[0] = f"([{c}, {c + 1}, {c - 1}])"  # the boundary in the first case
  return out


def _count_if(r, f):
  xs, x, n, c = _pick(r, _LISTS), _pick(r, _SCALAR), _pick(r, _ACC), int(r.integers(0, 10))
  src = (f"def {f}({xs}):\n  {n} = 0\n  for {x} in {xs}:\n    if {x} {_pick(r, _CMPS)} {c}:\n"
         f"      {n} += 1\n  return {n}\n")
  return src, _lists(r, c)


def _sum_if(r, f):
  xs, x, t, c = _pick(r, _LISTS), _pick(r, _SCALAR), _pick(r, _ACC), int(r.integers(0, 10))
  src = (f"def {f}({xs}):\n  {t} = 0\n  for {x} in {xs}:\n    if {x} {_pick(r, _CMPS)} {c}:\n"
         f"      {t} {_pick(r, ('+=', '-='))} {x}\n  return {t}\n")
  return src, _lists(r, c)


def _range_sum(r, f):
  n, i, t = _pick(r, _SCALAR, 2) + [_pick(r, _ACC)]
  c0, c1, c2 = int(r.integers(0, 3)), int(r.integers(0, 3)), int(r.integers(1, 4))
  src = (f"def {f}({n}):\n  {t} = {c0}\n  for {i} in range({c1}, {n} + 1):\n"
         f"    {t} += {i} {_pick(r, _AOPS)} {c2}\n  return {t}\n")
  return src, [f"({v})" for v in (c1 + 1, c1 + 3, c1, c1 + 5, c1 + 2)]


def _pair(r, f):
  a, b = _pick(r, _SCALAR, 2)
  c = int(r.integers(0, 10))
  src = (f"def {f}({a}, {b}):\n  if {a} {_pick(r, _CMPS)} {b}:\n    return {a} {_pick(r, _AOPS)} "
         f"{b}\n  return {b} {_pick(r, _AOPS)} {c}\n")
  pairs = [(3, 3), (2, 5), (7, 4), (0, 1), (6, 6)]
  return src, [f"({p}, {q})" for p, q in pairs]


def _both(r, f):
  a, b = _pick(r, _SCALAR, 2)
  c1, c2 = r.integers(0, 10, size=2)
  src = (f"def {f}({a}, {b}):\n  return {a} {_pick(r, _CMPS)} {c1} {_pick(r, ('and', 'or'))} "
         f"{b} {_pick(r, _CMPS)} {c2}\n")
  return src, [f"({int(c1) + d}, {int(c2) + e})" for d, e in ((0, 0), (1, -1), (-1, 1), (0, 2),
                                                               (2, 0))]


def _guarded(r, f):
  xs, c1 = _pick(r, _LISTS), int(r.integers(0, 10))
  src = (f"def {f}({xs}):\n  if not {xs}:\n    return {c1}\n"
         f"  return {xs}[0] {_pick(r, _AOPS)} len({xs})\n")
  return src, ["([])", "([4])", "([2, 7])", "([5, 1, 3])", "([9, 9])"]


TEMPLATES = (_threshold, _two_branch, _clamp, _count_if, _sum_if, _range_sum, _pair, _both,
             _guarded)


def _run(source: str, name: str, args: str):
  ns: dict = {}
  exec(compile(source, f"{name}.py", "exec"), ns)  # pylint: disable=exec-used
  return eval(f"{name}{args}", ns)  # pylint: disable=eval-used


def generate(n: int, seed: int = 0) -> list[tuple[str, str, list[tuple[str, str]]]]:
  """``n`` generated modules ``(name, source, cases)`` (module doc), names unique and distinct
  from the hand-written modules' (a ``g`` prefix). Deterministic in ``seed``. Raises ValueError
  for ``n < 0``."""
  if n < 0:
    raise ValueError(f"task.swe_generated must be >= 0, got {n}")
  r = np.random.default_rng(np.random.SeedSequence([int(seed), 2029]))
  out, names = [], set()
  while len(out) < n:
    base = f"g{_pick(r, _VERBS)}_{_pick(r, _NOUNS)}"
    name, k = base, 2
    while name in names:
      name, k = f"{base}{k}", k + 1
    template = TEMPLATES[int(r.integers(len(TEMPLATES)))]
    source, args = template(r, name)
    cases = [(f"{name}{a}", repr(_run(source, name, a))) for a in args]
    if len({e for _, e in cases}) < 2:
      continue  # a constant function: no mutant of it can be caught
    names.add(name)
    out.append((name, source, cases))
  return out

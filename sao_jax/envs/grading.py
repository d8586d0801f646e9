r"""Answer extraction and grading.

``grade(response_text, answer)`` returns 1.0 if the content of the *last*
``\boxed{...}`` in the response is mathematically equal to the gold answer,
else 0.0.  It never raises on model output.

Thread safety / timeouts
------------------------
Grading runs in background threads of the rollout worker.  math_verify's
default timeouts use ``signal.alarm``, which only works in the main thread,
so we call ``parse(..., parsing_timeout=None)`` and
``verify(..., timeout_seconds=None)``.  (math_verify logs a one-time warning
about this.)  Without a timeout, sympy can hang on inputs that denote huge
numbers (``9^{9^{9^9}}``, ``100000000!``, ``\binom{10^8}{5\cdot10^7}``,
``\Gamma(10^8)``), so predictions go through a conservative pre-filter first
(``_safe_for_sympy``) and anything suspicious is graded 0.0 without calling
math_verify:

* boxed content longer than ``MAX_PRED_CHARS`` characters;
* ``!`` (factorial; the LaTeX thin space ``\!`` is allowed) or ``**``;
* a LaTeX command outside ``_ALLOWED_COMMANDS`` (e.g. ``\binom``, ``\Gamma``,
  ``\gamma``, ``\sum``, ``\operatorname``);
* an exponent that itself contains ``^`` (nested powers), or exponents whose
  literal sizes could produce more than ``MAX_RESULT_DIGITS`` digits
  (estimated as: longest digit run x product over all exponents of
  prod(int(run) + 1) over the digit runs in that exponent).

The gold answer is trusted and not filtered.

Fast path: if both the boxed content and the gold answer are plain integers
(``[+-]?\d+``), they are compared as Python ints without math_verify (this is
the only path the arithmetic demo needs, and it costs microseconds).
"""

from __future__ import annotations

import functools
import logging
import re
from typing import Any
from math_verify import parse, verify

MAX_PRED_CHARS = 200
MAX_RESULT_DIGITS = 2_000_000

_INT_RE = re.compile(r"[+-]?\d+")
_BOX_RE = re.compile(r"\\boxed\s*\{")

_ALLOWED_COMMANDS = frozenset(
    """
    frac dfrac tfrac cfrac sqrt cdot times div pm mp pi infty left right
    big Big bigg Bigg bigl bigr Bigl Bigr text textbf textit textrm mathrm
    mathbf mathit mbox boxed circ degree dots ldots cdots le leq ge geq lt gt
    ne neq approx in notin cup cap emptyset varnothing setminus subset
    subseteq sin cos tan sec csc cot arcsin arccos arctan log ln exp lfloor
    rfloor lceil rceil quad qquad displaystyle mathbb overline angle triangle
    prime alpha beta delta epsilon varepsilon theta vartheta lambda mu sigma
    phi varphi omega tau rho eta xi zeta kappa nu chi psi to rightarrow mid
    colon langle rangle vert lvert rvert
    """.split()
)

logger = logging.getLogger(__name__)
# math_verify warns on every call that its signal-based timeouts are off; they must be off here
# (grading runs in rollout threads, where signal.alarm is unavailable) and inputs are screened
# by `_safe_for_sympy` instead, so the warning carries no information.
for _name in ("math_verify.parser", "math_verify.grader"):
  logging.getLogger(_name).setLevel(logging.ERROR)


def extract_boxed(text: str) -> str | None:
  r"""Content of the last complete ``\boxed{...}`` in ``text`` (or None).

  Braces are matched with nesting (``\boxed{\frac{1}{2}}`` -> ``\frac{1}{2}``);
  escaped braces ``\{`` / ``\}`` do not count.  Boxes are scanned left to
  right and a matched box is skipped as a whole, so for nested boxes the
  outermost one wins; an unterminated ``\boxed{`` is ignored (an earlier
  complete box, if any, is returned).  Returns the content unstripped.
  """
  if not isinstance(text, str):
    return None
  result: str | None = None
  pos = 0
  while True:
    m = _BOX_RE.search(text, pos)
    if m is None:
      return result
    start = m.end()  # index just after "{"
    end = _match_brace(text, start)
    if end is None:
      pos = m.start() + 1
    else:
      result = text[start:end]
      pos = end + 1


def _match_brace(text: str, start: int) -> int | None:
  """Index of the ``}`` closing a group whose ``{`` is at ``start - 1``."""
  depth = 1
  i, n = start, len(text)
  while i < n:
    c = text[i]
    if c == "\\":
      i += 2
      continue
    if c == "{":
      depth += 1
    elif c == "}":
      depth -= 1
      if depth == 0:
        return i
    i += 1
  return None


def _exponent_token(s: str, i: int) -> str:
  """The exponent starting at ``s[i]`` (just after a ``^``)."""
  n = len(s)
  while i < n and s[i] == " ":
    i += 1
  if i >= n:
    return ""
  if s[i] == "{":
    end = _match_brace(s, i + 1)
    return s[i:] if end is None else s[i : end + 1]
  if s[i] == "\\":
    j = i + 1
    while j < n and s[j].isalpha():
      j += 1
    if j == i + 1:  # \{ etc.
      j = min(n, j + 1)
    # include up to two following brace groups (\frac{a}{b})
    for _ in range(2):
      if j < n and s[j] == "{":
        end = _match_brace(s, j + 1)
        j = n if end is None else end + 1
    return s[i:j]
  return s[i]


def _safe_for_sympy(pred: str) -> bool:
  """Conservative filter against inputs that make sympy hang (see module doc)."""
  if len(pred) > MAX_PRED_CHARS:
    return False
  if "**" in pred or "!" in pred.replace("\\!", ""):
    return False
  for cmd in re.findall(r"\\([A-Za-z]+)", pred):
    if cmd not in _ALLOWED_COMMANDS:
      return False
  runs = re.findall(r"\d+", pred)
  longest = max((len(r) for r in runs), default=1)
  budget = MAX_RESULT_DIGITS // max(longest, 1)
  factor = 1
  for m in re.finditer(r"\^", pred):
    tok = _exponent_token(pred, m.end())
    if "^" in tok:
      return False
    for run in re.findall(r"\d+", tok):
      if len(run) > 7:
        return False
      factor *= int(run) + 1
      if factor > budget:
        return False
  return True


def _wrap(expr: str) -> str:
  s = expr.strip()
  if "\\boxed" in s or (s.startswith("$") and s.endswith("$") and len(s) >= 2):
    return s
  return "\\boxed{" + s + "}"


@functools.lru_cache(maxsize=4096)
def _parse_gold(answer: str) -> tuple[Any, ...]:

  return tuple(parse(_wrap(answer), parsing_timeout=None))


def _math_verify_equal(pred: str, answer: str) -> bool:

  gold = list(_parse_gold(answer))
  if not gold:
    return False
  target = parse(_wrap(pred), parsing_timeout=None)
  if not target:
    return False
  return bool(verify(gold, target, timeout_seconds=None))


def _norm_int(s: str) -> str:
  """Canonical decimal form of an integer string (string ops: no int() digit limit)."""
  neg = s.startswith("-")
  digits = s.lstrip("+-").lstrip("0") or "0"
  return "-" + digits if neg and digits != "0" else digits


def grade(response_text: str, answer: str) -> float:
  r"""1.0 if the last ``\boxed{}`` in ``response_text`` equals ``answer``, else 0.0.

  Safe to call from any thread; never raises on model output.
  """
  try:
    pred = extract_boxed(response_text)
    if pred is None:
      return 0.0
    pred = pred.strip()
    gold = str(answer).strip()
    if not pred:
      return 0.0
    if _INT_RE.fullmatch(pred) and _INT_RE.fullmatch(gold):
      return float(_norm_int(pred) == _norm_int(gold))
    if not _safe_for_sympy(pred):
      return 0.0
    return 1.0 if _math_verify_equal(pred, gold) else 0.0
  except Exception:  # garbage output must never crash the rollout
    logger.debug("grading failed for %r vs %r", response_text, answer, exc_info=True)
    return 0.0

r"""Small-number arithmetic for a real chat model (SmolLM2-135M-Instruct on 2 CPU cores).

Problems: ``"What is 13 + 14?"`` (answer ``"27"``) and ``"What is 17 - 9?"`` (``"8"``), operands
``1 .. max_operand`` (default 30), subtraction never negative. The prompt goes through the
model's chat template (``ChatMathEnv``): system message ``SYSTEM`` (one worked example of the
answer format, ``2 + 3``, which is therefore left out of both splits), user message the problem
(``INSTRUCTION`` is empty). Without the example SmolLM2-135M-Instruct copies an instruction's
empty ``\boxed{}`` and scores ~3% greedily; with it ~20%. The reward is ``MathEnv``'s:
math-verify (integer fast path) on the last ``\boxed{}`` of the response, 0 without a box. So a
response earns 1 only if it is both *formatted* (a number inside ``\boxed{}``) and *right*.

Train / held-out disjointness: the problem space is partitioned by a stable hash of the
*unordered* operand pair and the operator (``split_key``: ``"+:13,14"`` for both ``13 + 14`` and
``14 + 13``), so no held-out sum appears in training even with its operands swapped;
``eval`` holds about ``EVAL_FRACTION`` of the pairs. Each split is listed in a fixed order
shuffled by ``seed`` (``numpy`` ``SeedSequence([seed, split])``); ``make_problems(n, ...)``
returns its first ``n`` problems and raises ``ValueError`` when the split has fewer.
"""

from __future__ import annotations

import hashlib

import numpy as np

from sao_jax.data.jsonl import Problem

SYSTEM = "Example:\nUser: What is 2 + 3?\nAssistant: 2 + 3 = 5. The answer is \\boxed{5}."
INSTRUCTION = ""
EXAMPLE = (2, "+", 3)  # the pair SYSTEM shows: in neither split
EVAL_FRACTION = 0.25
_SPLITS = {"train": 0, "eval": 1}


def split_key(a: int, op: str, b: int) -> str:
  """The key the train / eval partition hashes: operator and sorted operands (``"+:13,14"``)."""
  lo, hi = sorted((int(a), int(b)))
  return f"{op}:{lo},{hi}"


def split_of(a: int, op: str, b: int) -> str:
  """``"eval"`` for about ``EVAL_FRACTION`` of the problems (blake2b of ``split_key``), else
  ``"train"``; independent of the seed, so the held-out set never leaks into training."""
  h = int.from_bytes(hashlib.blake2b(split_key(a, op, b).encode(), digest_size=8).digest(),
                     "little")
  return "eval" if (h % 1000) < EVAL_FRACTION * 1000 else "train"


def all_problems(max_operand: int = 30) -> list[tuple[int, str, int, int]]:
  """Every ``(a, op, b, answer)``: ``a + b`` for ``1 <= a, b <= max_operand`` and ``a - b`` for
  ``1 <= b <= a <= max_operand``, in a fixed order, without ``EXAMPLE`` (either order).
  Raises ValueError if ``max_operand < 2``."""
  if max_operand < 2:
    raise ValueError(f"task.max_operand must be >= 2, got {max_operand}")
  out = []
  skip = split_key(*EXAMPLE)
  for a in range(1, max_operand + 1):
    for b in range(1, max_operand + 1):
      if split_key(a, "+", b) != skip:
        out.append((a, "+", b, a + b))
      if b <= a:
        out.append((a, "-", b, a - b))
  return out


def expression(problem: Problem) -> str:
  """``"13 + 14"`` for the problem ``"What is 13 + 14?"`` (the ``{expr}`` of
  ``task.answer_prefix``). Raises ValueError for a prompt of another form."""
  p = problem.prompt
  if not (p.startswith("What is ") and p.endswith("?")):
    raise ValueError(f"not a chat_arith prompt: {p!r}")
  return p[len("What is "):-1]


def make_problems(n: int, seed: int = 0, split: str = "train",
                  max_operand: int = 30) -> list[Problem]:
  """The first ``n`` problems of ``split`` ("train" | "eval") in the seed's shuffled order.

  ``Problem(id="chat-arith-eval-0-000003", prompt="What is 13 + 14?", answer="27")``; distinct
  within a split, deterministic in ``(n, seed, split, max_operand)``. Raises ValueError for an
  unknown split, ``n < 0`` or ``n`` larger than the split (the message gives its size)."""
  if split not in _SPLITS:
    raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
  if n < 0:
    raise ValueError(f"n must be >= 0, got {n}")
  pool = [p for p in all_problems(max_operand) if split_of(p[0], p[1], p[2]) == split]
  if n > len(pool):
    field = "task.n_eval" if split == "eval" else "task.n_train"
    raise ValueError(f"{field}={n}: the {split} split of chat_arith with max_operand="
                     f"{max_operand} has only {len(pool)} problems; lower it or raise "
                     "task.max_operand")
  rng = np.random.default_rng(np.random.SeedSequence([int(seed), _SPLITS[split]]))
  order = rng.permutation(len(pool))[:n]
  return [Problem(id=f"chat-arith-{split}-{seed}-{i:06d}", prompt=f"What is {a} {op} {b}?",
                  answer=str(ans))
          for i, (a, op, b, ans) in enumerate(pool[j] for j in order)]

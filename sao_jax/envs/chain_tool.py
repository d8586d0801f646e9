r"""Chained tool use: problems that need 3-5 calculator calls, one binary operation each.

A CPU task in which a critic has something to learn (issue 16, item 1): the reward is binary and
comes at the end, but every tool observation shows how far the chain has got, so the value of a
state rises call by call and drops where the policy abandons the chain or miscopies a number.

Problems
--------
``make_problems(n, seed, split, lengths, weights)`` draws a chain of ``k`` steps (``k`` from
``lengths`` with probabilities ``weights``; default 3, 4 or 5 w.p. 0.2 / 0.5 / 0.3). Step 1 combines
two literals, every later step combines the previous step's result with a new literal (``+ -`` a
2-digit one, ``*`` a 1-digit one); every intermediate result lies in ``[100, 99999]``, so each
observation is at least 5 tokens (``<obs>``, >= 3 digits, ``</obs>``) and a solved 3-call
episode has >= 15 observation tokens::

    Problem(id="chain-train-0-000000", prompt="a=17*23;b=a-45;c=b*3. c?", answer="1038")

Train/eval disjointness is ``arith_tool``'s: independent random streams per split
(``SeedSequence([seed, 0 | 1])``) and a stable hash partition of the prompt text
(``arith_tool.split_of``: 10% eval), so no eval prompt can occur in any train set.

Token format (CharTokenizer) and tool
-------------------------------------
Exactly ``arith_tool``'s (``<bos>PROMPT\n``, actions ending in ``</tool>`` or ``<eos>``,
observations ``<obs>RESULT</obs>`` with loss mask 0), with one difference: the calculator does
*one* binary operation on two non-negative integer literals per call (``one_op_eval``); anything
else (``17*23-45``, ``a-45``, ``391``) is answered ``<obs>error</obs>``. The correct episode
for the problem above is (4 turns)::

    <tool>17*23</tool><obs>391</obs><tool>391-45</tool><obs>346</obs>
    <tool>346*3</tool><obs>1038</obs>\boxed{1038}<eos>

Episode rules, ``info`` and the optional tool latency are ``ArithToolEnv``'s. The default
``max_turns`` is ``max(lengths) + 2`` (every call, the answer and one spare turn).

Warm start (``make_sft_dataset``)
---------------------------------
The demonstrator is persistent for ``reliable_calls`` calls (default 3) and then makes each
further call only w.p. ``p_tool``; when it stops before the end of the chain it boxes a guess
(``arith_tool``'s guess: the answer w.p. ``p_guess_correct``, else off by up to ~25%). So
3-step chains are always solved in the demos, a 4-step chain w.p. ``p_tool``, a 5-step chain w.p.
``p_tool**2``: the greedy warm-started policy solves (about) the 3-step problems and stops after
3 calls on the longer ones, sampling at temperature 1 sometimes keeps going, and RL has to learn
to follow every chain to its end (while copying each observation into the next call without a
slip). The greedy warm-start success is therefore about ``weights[3 calls] x`` (copy accuracy).

Measured (``configs/chain_tool.py``, seed 0, 600 SFT steps of batch 32, 200 held-out problems).
Lengths (3, 4) w.p. (0.12, 0.88): greedy warm start 0.040, SAO 60 steps -> 0.635, but the
critic's explained variance only 0.09 over the last 10 steps: once both lengths are learnable,
success no longer depends on the state (a copy slip is not visible to a frozen-attention critic).
Weights (0.2, 0.8): warm start 0.19 (above the 5-15% target). Hence the default (3, 4, 5) w.p.
(0.2, 0.5, 0.3): warm start 0.115 greedy; SAO (20 value pre-training steps, 60 policy steps,
739 s at load ~6) -> 0.505 (+39 pts; 0.51 at step 20) with explained variance 0.4-0.8 over the
last 20 steps: the 4-call chains are learned, the 5-call ones mostly not, and the critic reads
the chain length from the prompt and the progress from the observations.
"""

from __future__ import annotations

import ast
import zlib
from typing import Sequence

import numpy as np

from sao_jax.data.jsonl import Problem
from sao_jax.envs import arith_tool
from sao_jax.envs.arith_eval import safe_eval_arith

__all__ = [
    "ChainToolEnv",
    "DEFAULT_LENGTHS",
    "DEFAULT_WEIGHTS",
    "VALUE_RANGE",
    "demo_actions",
    "log_filler",
    "make_demo",
    "make_problems",
    "make_sft_dataset",
    "one_op_eval",
    "problem_steps",
]

DEFAULT_LENGTHS: tuple[int, ...] = (3, 4, 5)
DEFAULT_WEIGHTS: tuple[float, ...] = (0.2, 0.5, 0.3)
VALUE_RANGE = (100, 99999)  # every intermediate result (inclusive)
_VARS = "abcdefgh"
_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*"}
_SPLITS = {"train": 0, "eval": 1}


def one_op_eval(expr: str | None) -> str:
  """The chain task's calculator: ``"391"`` for ``"17*23"``; ``"error"`` unless ``expr`` is
  exactly one of ``+ - *`` applied to two non-negative integer literals (``safe_eval_arith``'s
  bounds apply). Never raises."""
  if expr is None:
    return "error"
  try:
    node = ast.parse(expr.strip(), mode="eval").body
  except (SyntaxError, ValueError, MemoryError, RecursionError):
    return "error"
  if not (isinstance(node, ast.BinOp) and type(node.op) in _OPS
          and all(isinstance(x, ast.Constant) and type(x.value) is int
                  for x in (node.left, node.right))):
    return "error"
  try:
    return str(safe_eval_arith(expr))
  except ValueError:
    return "error"


def _check_lengths(lengths: Sequence[int], weights: Sequence[float]) -> np.ndarray:
  if not lengths or len(lengths) != len(weights):
    raise ValueError(f"task.chain_lengths={tuple(lengths)} and task.chain_weights="
                     f"{tuple(weights)} must be non-empty and of the same length")
  if any(int(k) < 1 or int(k) > len(_VARS) for k in lengths):
    raise ValueError(f"task.chain_lengths={tuple(lengths)}: each must be in 1..{len(_VARS)}")
  w = np.asarray(weights, np.float64)
  if np.any(w < 0) or not np.isfinite(w).all() or w.sum() <= 0:
    raise ValueError(f"task.chain_weights={tuple(weights)} must be >= 0 with a positive sum")
  return w / w.sum()


def _sample_step(rng: np.random.Generator, left: int | None) -> tuple[str, int, int, int]:
  """(op, left, right, result) with result in VALUE_RANGE; ``left`` None = step 1 (a literal).

  Literals: step 1 ``x + - y`` with x 3-digit, y 2-digit, or ``x * y`` with x 2-digit, y 1-digit;
  later steps ``+ -`` a 2-digit or ``*`` a 1-digit literal (2..9)."""
  lo, hi = VALUE_RANGE
  while True:
    op = "+-*"[int(rng.integers(3))]
    if left is None:
      x = int(rng.integers(10, 100)) if op == "*" else int(rng.integers(100, 1000))
    else:
      x = left
    y = int(rng.integers(2, 10)) if op == "*" else int(rng.integers(10, 100))
    r = x + y if op == "+" else x - y if op == "-" else x * y
    if lo <= r <= hi:
      return op, x, y, r


def _sample_chain(rng: np.random.Generator, k: int) -> tuple[str, int]:
  steps, prev = [], None
  for i in range(k):
    op, x, y, prev = _sample_step(rng, prev)
    lhs = str(x) if i == 0 else _VARS[i - 1]
    steps.append(f"{_VARS[i]}={lhs}{op}{y}")
  return ";".join(steps) + f". {_VARS[k - 1]}?", prev


def make_problems(n: int, seed: int = 0, split: str = "train",
                  lengths: Sequence[int] = DEFAULT_LENGTHS,
                  weights: Sequence[float] = DEFAULT_WEIGHTS) -> list[Problem]:
  """``n`` distinct deterministic chain problems of ``split`` ("train" | "eval") (module doc).

  Raises ValueError for a bad split, ``n < 0`` or bad ``lengths``/``weights``."""
  if split not in _SPLITS:
    raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
  if n < 0:
    raise ValueError(f"n must be >= 0, got {n}")
  p = _check_lengths(lengths, weights)
  rng = np.random.default_rng(np.random.SeedSequence([int(seed), _SPLITS[split]]))
  seen: set[str] = set()
  problems: list[Problem] = []
  while len(problems) < n:
    k = int(lengths[int(rng.choice(len(lengths), p=p))])
    prompt, answer = _sample_chain(rng, k)
    if prompt in seen or arith_tool.split_of(prompt) != split:
      continue
    seen.add(prompt)
    problems.append(Problem(id=f"chain-{split}-{seed}-{len(problems):06d}", prompt=prompt,
                            answer=str(answer)))
  return problems


def problem_steps(problem: Problem) -> list[tuple[str, int]]:
  """The chain as ``[("", first literal), (op, literal), ...]`` (one ``(op, literal)`` per step).

  E.g. ``"a=17*23;b=a-45;c=b*3. c?"`` -> ``[("", 17), ("*", 23), ("-", 45), ("*", 3)]``.
  Raises ValueError for a prompt that is not a chain problem."""
  try:
    body = problem.prompt.split(". ")[0]
    out: list[tuple[str, int]] = []
    for i, step in enumerate(body.split(";")):
      rhs = step.split("=", 1)[1]
      node = ast.parse(rhs, mode="eval").body
      if i == 0:
        out.append(("", int(node.left.value)))
      out.append((_OPS[type(node.op)], int(node.right.value)))
    return out
  except (IndexError, SyntaxError, AttributeError, KeyError, TypeError, ValueError):
    raise ValueError(f"not a chain problem prompt: {problem.prompt!r}") from None


def demo_actions(problem: Problem, n_calls: int, final: str) -> list[str]:
  """The action texts of an episode that makes the first ``n_calls`` correct calls of the chain
  and then answers ``\\boxed{final}<eos>``; e.g. ``["<tool>17*23</tool>", "<tool>391-45</tool>",
  "\\boxed{346}<eos>"]``."""
  steps = problem_steps(problem)
  actions, value = [], steps[0][1]
  for op, y in steps[1:n_calls + 1]:
    expr = f"{value}{op}{y}"
    actions.append(f"<tool>{expr}</tool>")
    value = int(one_op_eval(expr))
  return actions + ["\\boxed{" + final + "}<eos>"]


def make_demo(problem: Problem, n_calls: int, final: str, tokenizer, obs_pad: int = 0
              ) -> tuple[list[int], list[int]]:
  """SFT demonstration ``(token_ids, loss_mask)``: ``demo_actions`` replayed through a
  ``ChainToolEnv`` (so the observations are the env's, padded by ``obs_pad``); loss mask 1 on
  action tokens, 0 on the prompt and observations."""
  env = ChainToolEnv(tokenizer, max_turns=n_calls + 1, obs_pad=obs_pad)
  ids = env.prompt_ids(problem)
  mask = [0] * len(ids)
  for turn, action in enumerate(demo_actions(problem, n_calls, final)):
    a = tokenizer.encode(action)
    st = env.step(problem, turn, a)
    ids += a + list(st.observation_ids)
    mask += [1] * len(a) + [0] * len(st.observation_ids)
  return ids, mask


def make_sft_dataset(problems: Sequence[Problem], p_tool: float, seed: int, tokenizer,
                     p_guess_correct: float = 0.1, reliable_calls: int = 3, obs_pad: int = 0
                     ) -> list[tuple[list[int], list[int]]]:
  """One demo per problem from the demonstrator of the module doc: ``reliable_calls`` calls
  always, each further call w.p. ``p_tool``; stopping early boxes a guess (correct w.p.
  ``p_guess_correct``). Deterministic in ``seed``."""
  if not 0.0 <= p_tool <= 1.0 or not 0.0 <= p_guess_correct <= 1.0:
    raise ValueError(f"sft.p_tool={p_tool} and sft.p_guess_correct={p_guess_correct} must be "
                     "in [0, 1]")
  if reliable_calls < 0:
    raise ValueError(f"sft.reliable_calls={reliable_calls} must be >= 0")
  rng = np.random.default_rng(seed)
  out = []
  for problem in problems:
    k = len(problem_steps(problem)) - 1
    n = min(k, reliable_calls)
    while n < k and rng.random() < p_tool:
      n += 1
    final = (problem.answer if n == k else
             str(arith_tool._guess(int(problem.answer), rng, p_guess_correct)))  # pylint: disable=protected-access
    out.append(make_demo(problem, n, final, tokenizer, obs_pad))
  return out


LOG_CHARS = "abcdefghijklmnopqrstuvwxyz "  # the filler of a padded observation (no digits)


def log_filler(result: str, n: int) -> str:
  """``n`` characters of ``LOG_CHARS`` that look like noise but are a pure function of
  ``result`` (``crc32`` seeds them), so an episode's observations are deterministic."""
  rng = np.random.default_rng(zlib.crc32(result.encode()))
  return "".join(LOG_CHARS[i] for i in rng.integers(0, len(LOG_CHARS), size=n))


class ChainToolEnv(arith_tool.ArithToolEnv):
  """``ArithToolEnv`` whose calculator does one binary operation per call (``one_op_eval``).

  Args: tokenizer (CharTokenizer), max_turns (>= 1; e.g. ``max(lengths) + 2``),
  ``ArithToolEnv``'s tool latency and seed arguments, and ``obs_pad`` (>= 0, default 0): the
  long-observation variant (``task.obs_pad``), where each observation is
  ``<obs>`` + ``obs_pad`` characters of noise (``log_filler``: letters and spaces, no digits,
  no information) + ``=RESULT</obs>``, so every tool output is ``obs_pad + 3 +`` len(RESULT)
  tokens -- a task in which naive token GAE decays the terminal reward through 100+ observation
  tokens per turn and skip-observation GAE does not. Raises ValueError as ``ArithToolEnv`` and
  for ``obs_pad < 0``."""

  run_tool = staticmethod(one_op_eval)

  def __init__(self, tokenizer, max_turns: int = 3, tool_latency_median_s: float = 0.0,
               tool_latency_sigma: float = 1.0, seed: int = 0, obs_pad: int = 0):
    super().__init__(tokenizer, max_turns, tool_latency_median_s, tool_latency_sigma, seed)
    if obs_pad < 0:
      raise ValueError(f"task.obs_pad={obs_pad} must be >= 0 (0: plain observations)")
    self.obs_pad = int(obs_pad)

  def observation_ids(self, result: str) -> list[int]:
    """Tokens of ``<obs>RESULT</obs>``, or with ``obs_pad`` > 0 ``<obs>NOISE=RESULT</obs>``."""
    if not self.obs_pad:
      return super().observation_ids(result)
    return super().observation_ids(log_filler(result, self.obs_pad) + "=" + result)

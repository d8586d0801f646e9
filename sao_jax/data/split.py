r"""Train/eval split of the packaged math data: which file trains, which evaluates, and the check
that no training problem appears in any evaluation set.

Every file in ``sao_jax/data/files`` has exactly one role (``ROLES``; a test fails for a file
without one):

| file | rows | role | in the paper's tables |
|---|---:|---|---|
| gsm8k_train.jsonl | 7473 | train | |
| math500.jsonl | 500 | train | |
| aime24.jsonl | 30 | train | |
| amc23.jsonl | 40 | train | |
| hmmt_feb24.jsonl | 30 | train | |
| aime25.jsonl | 30 | eval | AIME 2025 (16 samples) |
| hmmt_feb25.jsonl | 30 | eval | HMMT Feb 2025 (16 samples) |
| beyondaime.jsonl | 100 | eval | BeyondAIME (4 samples) |
| imo_answerbench.jsonl | 400 | eval | IMO-AnswerBench (16 samples) |
| gsm8k_test.jsonl | 1319 | eval | (the GSM8K configs' held-out set) |

``TRAIN_MIX`` (the five train files, 8,073 problems) is the training set of ``configs/aime.py``;
the paper's four benchmarks (``PAPER_BENCHMARKS``) are 2025 competitions (AIME 2025, HMMT
February 2025), BeyondAIME and IMO-AnswerBench, none of which the mix contains. MATH-500 and the
2023/2024 competitions train here, so a score on them from a model trained with this mix is not
a held-out number. Sources and licences of every file: the data README of the shared folder
beside the checkout (copied with only ``id``, ``problem``, ``answer`` and a few small fields;
solutions dropped).

Disjointness is checked on ``normalize_problem`` text (lowercase; ``\left``/``\right``/
``\displaystyle`` dropped; ``\dfrac``/``\tfrac`` -> ``\frac``; LaTeX spacing ``\,`` ``\;``
``\:`` ``\!`` ``\ `` ``\quad`` ``\qquad`` ``~`` and ``$`` dropped; all whitespace removed).
On the shipped files there is no exact match between any two files, and (checked once when the
files were added) no problem of the competition files or MATH-500 shares more than 30% of its
40-character shingles with a problem of any other file (GSM8K train vs test: exact check only).
``load_train_mix`` re-checks at load time and raises if a problem of an evaluation set got in.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterable, Sequence

from sao_jax.data.jsonl import Problem, load_math_problems, packaged_path

__all__ = ["ROLES", "TRAIN_MIX", "EVAL_SETS", "PAPER_BENCHMARKS", "Benchmark",
           "normalize_problem", "overlaps", "load_files", "load_train_mix", "parse_file_list"]

TRAIN_MIX: tuple[str, ...] = ("gsm8k_train.jsonl", "math500.jsonl", "aime24.jsonl",
                              "amc23.jsonl", "hmmt_feb24.jsonl")
EVAL_SETS: tuple[str, ...] = ("aime25.jsonl", "hmmt_feb25.jsonl", "beyondaime.jsonl",
                              "imo_answerbench.jsonl", "gsm8k_test.jsonl")
ROLES: dict[str, str] = {**{f: "train" for f in TRAIN_MIX}, **{f: "eval" for f in EVAL_SETS}}


@dataclasses.dataclass(frozen=True)
class Benchmark:
  """A benchmark of the paper's evaluation protocol: ``samples`` per problem, table ``title``."""
  name: str
  file: str
  samples: int
  title: str


# The paper's evaluation: mean accuracy over 16 samples per problem (4 for BeyondAIME),
# temperature 1.0, top-p 1.0, multi-turn with the Python tool.
PAPER_BENCHMARKS: tuple[Benchmark, ...] = (
    Benchmark("aime25", "aime25.jsonl", 16, "AIME 2025"),
    Benchmark("hmmt_feb25", "hmmt_feb25.jsonl", 16, "HMMT Feb 2025"),
    Benchmark("beyondaime", "beyondaime.jsonl", 4, "BeyondAIME"),
    Benchmark("imo_answerbench", "imo_answerbench.jsonl", 16, "IMO-AnswerBench"),
)

_DROP_CMD = re.compile(r"\\(?:left|right|displaystyle)(?![A-Za-z])")
_FRAC = re.compile(r"\\[dt]frac(?![A-Za-z])")
_SPACING = re.compile(r"\\[,;:! ]|\\q?quad(?![A-Za-z])|~|\$")
_WS = re.compile(r"\s+")


def normalize_problem(text: str) -> str:
  r"""Problem text in the form the overlap check compares (module doc).

  ``normalize_problem("Find  $x$ if $\dfrac{x}{2}=\,3$.") == r"findxif\frac{x}{2}=3."``"""
  s = text.lower()
  s = _DROP_CMD.sub("", s)
  s = _FRAC.sub(r"\\frac", s)
  s = _SPACING.sub("", s)
  return _WS.sub("", s)


def overlaps(train: Iterable[Problem], evals: Iterable[Problem]) -> list[tuple[str, str]]:
  """``(train id, eval id)`` for every training problem whose normalized text equals that of an
  evaluation problem (empty when the sets are disjoint)."""
  index: dict[str, str] = {}
  for p in evals:
    index.setdefault(normalize_problem(p.prompt), p.id)
  return [(p.id, index[k]) for p in train if (k := normalize_problem(p.prompt)) in index]


def _path(name: str) -> str:
  return name if "/" in name else packaged_path(name)


def load_files(names: Sequence[str]) -> list[Problem]:
  """Problems of the given files (packaged names or paths), in order; ids must be unique across
  the files. Raises ValueError for a duplicate id (naming both files)."""
  out: list[Problem] = []
  seen: dict[str, str] = {}
  for name in names:
    for p in load_math_problems(_path(name), blank_lines="error"):
      if p.id in seen:
        raise ValueError(f"problem id {p.id!r} is in both {seen[p.id]} and {name}; "
                         "ids must be unique across task.train_file")
      seen[p.id] = name
      out.append(p)
  return out


def parse_file_list(value: str) -> list[str]:
  """``"a.jsonl, b.jsonl"`` -> ``["a.jsonl", "b.jsonl"]``; ``"paper_mix"`` -> ``TRAIN_MIX``."""
  names = [s.strip() for s in str(value).split(",") if s.strip()]
  if names == ["paper_mix"]:
    return list(TRAIN_MIX)
  return names


def load_train_mix(names: Sequence[str] = TRAIN_MIX,
                   eval_sets: Sequence[str] = EVAL_SETS) -> list[Problem]:
  """The training problems of ``names``, checked against every file of ``eval_sets``.

  Raises ValueError (listing up to 5 ``train id == eval id`` pairs and the field to fix) when a
  training problem's normalized text is in an evaluation set, or when a file is in both lists."""
  both = sorted(set(names) & set(eval_sets))
  if both:
    raise ValueError(f"task.train_file lists evaluation set(s) {both}: training on the problems "
                     "a config evaluates on contaminates every number; remove them "
                     f"(training files: {list(TRAIN_MIX)}).")
  train = load_files(names)
  bad = overlaps(train, load_files(eval_sets))
  if bad:
    pairs = ", ".join(f"{a} == {b}" for a, b in bad[:5])
    raise ValueError(f"{len(bad)} training problem(s) of task.train_file={list(names)} are in an "
                     f"evaluation set ({pairs}); drop them from the training file.")
  return train

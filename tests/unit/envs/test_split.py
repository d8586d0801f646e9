"""The train/eval split of the packaged data (``sao_jax/data/split.py``): every shipped file has
a role, and no training problem appears in any evaluation set (normalized problem text)."""

import os

import pytest

from sao_jax.data import split
from sao_jax.data.jsonl import Problem, load_math_problems, packaged_path

FILES = os.path.dirname(packaged_path("aime25.jsonl"))
SHIPPED = sorted(f for f in os.listdir(FILES) if f.endswith(".jsonl"))


def test_every_shipped_file_has_a_role():
  assert sorted(split.ROLES) == SHIPPED
  assert {b.file for b in split.PAPER_BENCHMARKS} <= set(split.EVAL_SETS)
  assert [(b.name, b.samples) for b in split.PAPER_BENCHMARKS] == [
      ("aime25", 16), ("hmmt_feb25", 16), ("beyondaime", 4), ("imo_answerbench", 16)]


def test_no_training_problem_is_in_any_evaluation_set():
  """Every training file against every evaluation file, on normalized text: no match at all."""
  train = {f: load_math_problems(packaged_path(f)) for f in split.TRAIN_MIX}
  evals = {f: load_math_problems(packaged_path(f)) for f in split.EVAL_SETS}
  assert sum(len(v) for v in train.values()) == 8073
  assert {f: len(v) for f, v in evals.items()} == {
      "aime25.jsonl": 30, "hmmt_feb25.jsonl": 30, "beyondaime.jsonl": 100,
      "imo_answerbench.jsonl": 400, "gsm8k_test.jsonl": 1319}
  for tf, tp in train.items():
    for ef, ep in evals.items():
      assert split.overlaps(tp, ep) == [], (tf, ef)
  # the shipped files are free of internal duplicates too (a duplicate would hide in the mix)
  every = [p for f in SHIPPED for p in load_math_problems(packaged_path(f))]
  norm = [split.normalize_problem(p.prompt) for p in every]
  assert len(set(norm)) == len(norm)


def test_normalization_catches_formatting_variants():
  a = "Find  $x$ if $\\dfrac{x}{2} = 3$."
  for b in ("find x if $\\frac{x}{2}=3$.", "Find x if \\tfrac{x}{2}\\,=\\;3.",
            "FIND $x$\nif $\\displaystyle\\frac{x}{2}=~3$."):
    assert split.normalize_problem(a) == split.normalize_problem(b) == "findxif\\frac{x}{2}=3.", b
  assert split.normalize_problem(a) != split.normalize_problem("Find x if x/2 = 4.")
  assert split.normalize_problem("\\left( \\leftarrow \\right)") == "(\\leftarrow)"


def test_load_train_mix_refuses_contamination(tmp_path):
  mix = split.load_train_mix()
  assert len(mix) == 8073 and len({p.id for p in mix}) == 8073
  with pytest.raises(ValueError, match="task.train_file lists evaluation set"):
    split.load_train_mix(["gsm8k_train.jsonl", "aime25.jsonl"])
  aime = load_math_problems(packaged_path("aime25.jsonl"))
  leaked = tmp_path / "leak.jsonl"
  leaked.write_text('{"id": "x-1", "problem": %s, "answer": "1"}\n'
                    % __import__("json").dumps("  " + aime[3].prompt.upper() + " "))
  with pytest.raises(ValueError, match=r"x-1 == aime-2025-I-04"):
    split.load_train_mix([str(leaked)])
  assert split.overlaps([Problem("t", "What is 2+2?", "4")],
                        [Problem("e", "what is 2 + 2 ?", "4")]) == [("t", "e")]


def test_parse_file_list():
  assert split.parse_file_list("paper_mix") == list(split.TRAIN_MIX)
  assert split.parse_file_list(" a.jsonl, b.jsonl ,") == ["a.jsonl", "b.jsonl"]

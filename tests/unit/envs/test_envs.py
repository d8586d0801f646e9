"""Tests for sao_jax.envs: arithmetic evaluator, grading, ArithToolEnv, MathEnv."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from sao_jax.data.jsonl import Problem
from sao_jax.data.tokenizer import CharTokenizer
from sao_jax.envs.arith_eval import safe_eval_arith
from sao_jax.envs.arith_tool import (
    ArithToolEnv,
    make_demo,
    make_problems,
    make_sft_dataset,
    problem_expression,
    split_of,
    tool_latency,
)
from sao_jax.envs.base import Env, EnvStep
from sao_jax.envs.grading import extract_boxed, grade
from sao_jax.envs.math_env import MathEnv

TOK = CharTokenizer()
PROB = Problem(id="t0", prompt="Compute 347*29-118.", answer="9945")


def enc(text: str) -> list[int]:
  return TOK.encode(text)


# ------------------------------------------------------------- safe_eval_arith
@pytest.mark.parametrize(
    "expr,value",
    [
        ("347*29-118", 9945),
        ("1+2*3", 7),
        ("(1+2)*3", 9),
        ("-5+2", -3),
        ("--5", 5),
        ("7//2", 3),
        ("-7//2", -4),
        (" 12 * ( 3 - 5 ) ", -24),
        ("(673+37)*13", 9230),
        ("10*1", 10),
        ("999999*1000000", 999999000000),
    ],
)
def test_safe_eval_values(expr, value):
  assert safe_eval_arith(expr) == value


@pytest.mark.parametrize(
    "expr",
    [
        "__import__('os')",
        "__import__('os').system('true')",
        "os",
        "x+1",
        "(1).__class__",
        "abs(-1)",
        "2**999999",
        "2**3",
        "7/2",
        "7%2",
        "1.5+1",
        "'a'*3",
        "True+1",
        "+5",
        "[1,2]",
        "1 if 1 else 2",
        "1;2",
        "1000000000000*10",
        "1000000*1000000+1",
        "9" * 13,
        "9" * 65,
        "1+" * 40 + "1",
        "1//0",
        "",
        "   ",
        "1+",
        "lambda: 1",
        "1\x00",
    ],
)
def test_safe_eval_rejects(expr):
  with pytest.raises(ValueError):
    safe_eval_arith(expr)


def test_safe_eval_bounds_are_inclusive():
  assert safe_eval_arith("1000000*1000000") == 10**12
  assert safe_eval_arith("-1000000*1000000") == -(10**12)
  with pytest.raises(ValueError):
    safe_eval_arith(None)  # type: ignore[arg-type]


# --------------------------------------------------------------------- grading
@pytest.mark.parametrize(
    "text,boxed",
    [
        ("so \\boxed{70}.", "70"),
        ("\\boxed{1} then \\boxed{2}", "2"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),
        ("\\boxed{3} and \\boxed{4", "3"),
        ("\\boxed{\\boxed{5}}", "\\boxed{5}"),
        ("no box", None),
        ("\\boxed{", None),
        ("\\boxed 5", None),
        ("", None),
    ],
)
def test_extract_boxed(text, boxed):
  assert extract_boxed(text) == boxed


@pytest.mark.parametrize(
    "text,answer,expected",
    [
        ("The answer is \\boxed{70}", "70", 1.0),
        ("\\boxed{ 70 }", "70", 1.0),
        ("\\boxed{070}", "70", 1.0),
        ("\\boxed{71}", "70", 0.0),
        ("\\boxed{-3}", "-3", 1.0),
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\dfrac{140}{2}}", "70", 1.0),
        ("\\boxed{70^\\circ}", "70", 1.0),
        ("\\boxed{\\frac{1}{3}}", "0.5", 0.0),
        ("70", "70", 0.0),  # no box -> 0
        ("\\boxed{}", "70", 0.0),
        ("\\boxed{}}}{{\\frac", "70", 0.0),
        ("\\boxed{<tool>}", "70", 0.0),
        ("\x00\xff garbage \\boxed{\\\\\\}", "70", 0.0),
        ("\\boxed{" + "9" * 5000 + "}", "70", 0.0),
    ],
)
def test_grade(text, answer, expected):
  assert grade(text, answer) == expected


@pytest.mark.parametrize(
    "pred",
    [
        "9^{9^{9^{9}}}",
        "9^{999999999}",
        "10^{10^{10}}",
        "100000000!",
        "\\binom{100000000}{50000000}",
        "\\Gamma(100000000)",
        "\\gamma(100000000)",
        "9**9**9**9",
        "x" * 1000,
    ],
)
def test_grade_pathological_inputs_are_fast(pred):
  t0 = time.perf_counter()
  assert grade("\\boxed{" + pred + "}", "70") == 0.0
  assert time.perf_counter() - t0 < 2.0


def test_grade_never_raises_on_non_str():
  assert grade(None, "70") == 0.0  # type: ignore[arg-type]
  assert grade(12345, "70") == 0.0  # type: ignore[arg-type]


def test_grade_in_threads():
  """math_verify must run with signal-based timeouts disabled (non-main thread)."""
  cases = [
      ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
      ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
      ("\\boxed{\\sqrt{4}}", "2", 1.0),
      ("\\boxed{3}", "\\frac{1}{2}", 0.0),
      ("\\boxed{70}", "70", 1.0),
  ]
  results: dict[int, list[float]] = {}
  errors: list[BaseException] = []

  def work(k: int) -> None:
    try:
      results[k] = [grade(t, a) for t, a, _ in cases]
    except BaseException as e:  # pragma: no cover - reported below
      errors.append(e)

  threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=60)
  assert not errors
  expected = [e for _, _, e in cases]
  assert results == {k: expected for k in range(4)}


# ---------------------------------------------------------------- ArithToolEnv
def test_env_protocol():
  assert isinstance(ArithToolEnv(TOK), Env)
  assert isinstance(MathEnv(TOK), Env)
  assert ArithToolEnv(TOK).max_turns == 3


def test_arith_prompt_ids():
  env = ArithToolEnv(TOK)
  ids = env.prompt_ids(PROB)
  assert ids[0] == TOK.bos_id
  assert TOK.decode(ids) == "<bos>Compute 347*29-118.\n"


def test_arith_full_tool_episode_reward_1():
  env = ArithToolEnv(TOK)
  seq = env.prompt_ids(PROB)
  a0 = enc("<tool>347*29-118</tool>")
  s0 = env.step(PROB, 0, a0)
  assert isinstance(s0, EnvStep)
  assert not s0.done and s0.reward == 0.0
  assert s0.observation_ids == enc("<obs>9945</obs>")
  assert s0.observation_ids == [TOK.obs_start_id, *enc("9945"), TOK.obs_end_id]
  assert TOK.decode(s0.observation_ids) == "<obs>9945</obs>"
  assert s0.info["tool_calls"] == 1 and s0.info["tool_result"] == "9945"
  seq += a0 + s0.observation_ids
  a1 = enc("\\boxed{9945}<eos>")
  s1 = env.step(PROB, 1, a1)
  assert s1.done and s1.reward == 1.0 and s1.observation_ids == []
  assert s1.info["answer"] == "9945" and s1.info["tool_calls"] == 0
  assert not s1.info["truncated"]
  seq += a1
  assert TOK.decode(seq) == (
      "<bos>Compute 347*29-118.\n<tool>347*29-118</tool><obs>9945</obs>\\boxed{9945}<eos>"
  )


def test_tool_latency_hand_values_and_determinism():
  # sigma = 0: exactly the median, whatever the trajectory; median 0: off
  assert tool_latency("a", 0, [1, 2], 0.25, 0.0) == 0.25
  assert tool_latency("zz#g3", 2, [9], 0.25, 0.0, seed=7) == 0.25
  assert tool_latency("a", 0, [1, 2], 0.0, 3.0) == 0.0
  # a draw is median * exp(sigma * z) with the same z for every (median, sigma)
  z = np.log(tool_latency("a", 0, [1, 2], 1.0, 1.0))
  assert tool_latency("a", 0, [1, 2], 0.2, 1.5) == pytest.approx(0.2 * np.exp(1.5 * z))
  # deterministic per (seed, problem id, turn, action); any of them changes the draw
  base = tool_latency("a", 0, [1, 2], 0.2, 1.0)
  assert base == tool_latency("a", 0, [1, 2], 0.2, 1.0)
  for other in (tool_latency("b", 0, [1, 2], 0.2, 1.0), tool_latency("a", 1, [1, 2], 0.2, 1.0),
                tool_latency("a", 0, [1, 3], 0.2, 1.0),
                tool_latency("a", 0, [1, 2], 0.2, 1.0, seed=1)):
    assert other != base
  with pytest.raises(ValueError, match="tool_latency_median_s"):
    tool_latency("a", 0, [], -0.1, 1.0)
  with pytest.raises(ValueError, match="tool_latency_sigma"):
    ArithToolEnv(TOK, tool_latency_median_s=0.2, tool_latency_sigma=-1.0)


def test_tool_latency_is_lognormal_with_the_stated_median_and_tail():
  """median 0.2 s, sigma 1: median 0.2, P(> 0.2 e) = 15.9%, P(> 0.2 e^2.326) = 1%,
  mean 0.2 e^0.5 = 0.330 (4000 seeded draws, so the bounds are a few standard errors)."""
  x = np.array([tool_latency(f"arith-train-0-{i:06d}", 0, [5, 6], 0.2, 1.0)
                for i in range(4000)])
  assert (x > 0).all()
  assert np.median(x) == pytest.approx(0.2, rel=0.06)
  assert np.mean(x > 0.2 * np.e) == pytest.approx(0.1587, abs=0.02)
  assert np.mean(x > 0.2 * np.exp(2.326)) == pytest.approx(0.01, abs=0.005)
  assert np.mean(x) == pytest.approx(0.2 * np.exp(0.5), rel=0.08)
  z = np.log(x / 0.2)
  assert np.mean(z) == pytest.approx(0.0, abs=0.05) and np.std(z) == pytest.approx(1.0, abs=0.05)


def test_arith_tool_call_sleeps_the_latency_and_answers_do_not():
  env = ArithToolEnv(TOK, tool_latency_median_s=0.15, tool_latency_sigma=0.0)
  t0 = time.perf_counter()
  s0 = env.step(PROB, 0, enc("<tool>347*29-118</tool>"))
  assert time.perf_counter() - t0 >= 0.15
  assert s0.info["tool_latency_s"] == 0.15 and s0.observation_ids == enc("<obs>9945</obs>")
  t0 = time.perf_counter()
  s1 = env.step(PROB, 1, enc("\\boxed{9945}<eos>"))
  assert time.perf_counter() - t0 < 0.15 and s1.reward == 1.0
  assert ArithToolEnv(TOK).step(PROB, 0, enc("<tool>1+1</tool>")).info["tool_latency_s"] == 0.0


def test_arith_wrong_box_and_no_box():
  env = ArithToolEnv(TOK)
  s = env.step(PROB, 0, enc("\\boxed{9944}<eos>"))
  assert s.done and s.reward == 0.0
  s = env.step(PROB, 0, enc("\\boxed{9945}<eos>"))
  assert s.done and s.reward == 1.0  # direct correct answer also counts
  s = env.step(PROB, 0, enc("9945<eos>"))
  assert s.done and s.reward == 0.0 and s.info["answer"] is None


def test_arith_tool_errors():
  env = ArithToolEnv(TOK)
  for action in ["<tool>__import__('os')</tool>", "<tool>2**99</tool>", "<tool></tool>",
                 "347*29</tool>"]:
    s = env.step(PROB, 0, enc(action))
    assert not s.done
    assert TOK.decode(s.observation_ids) == "<obs>error</obs>"
  # expression taken from the last <tool>
  s = env.step(PROB, 0, enc("<tool>1+1 <tool>2*3</tool>"))
  assert TOK.decode(s.observation_ids) == "<obs>6</obs>"
  s = env.step(PROB, 0, enc("<tool>5-7</tool>"))
  assert TOK.decode(s.observation_ids) == "<obs>-2</obs>"


def test_arith_truncated_and_max_turns():
  env = ArithToolEnv(TOK, max_turns=3)
  s = env.step(PROB, 0, enc("\\boxed{9945}"))  # no stop token: length limit
  assert s.done and s.reward == 0.0 and s.info["truncated"] and s.observation_ids == []
  s = env.step(PROB, 0, [])
  assert s.done and s.info["truncated"]
  # tool call on the last allowed turn ends the episode
  s = env.step(PROB, 2, enc("<tool>347*29-118</tool>"))
  assert s.done and s.reward == 0.0 and s.observation_ids == []
  s = env.step(PROB, 2, enc("\\boxed{9945}<tool>1+1</tool>"))
  assert s.done and s.reward == 1.0
  s = env.step(PROB, 1, enc("<tool>1+1</tool>"))
  assert not s.done
  one = ArithToolEnv(TOK, max_turns=1)
  assert one.step(PROB, 0, enc("<tool>1+1</tool>")).done


def test_arith_garbage_actions_never_raise():
  env = ArithToolEnv(TOK)
  rng = np.random.default_rng(0)
  for turn in range(3):
    for _ in range(200):
      n = int(rng.integers(0, 40))
      ids = [int(x) for x in rng.integers(0, TOK.vocab_size + 10, size=n)]
      s = env.step(PROB, turn, ids)
      assert s.reward in (0.0, 1.0)
      assert s.done or s.observation_ids


# ---------------------------------------------------------------------- demos
def _spans(ids, mask, want):
  return TOK.decode([i for i, m in zip(ids, mask) if m == want])


def test_tool_demo_loss_mask():
  ids, mask = make_demo(PROB, True, np.random.default_rng(0), TOK)
  assert len(ids) == len(mask) and set(mask) <= {0, 1}
  assert TOK.decode(ids) == (
      "<bos>Compute 347*29-118.\n<tool>347*29-118</tool><obs>9945</obs>\\boxed{9945}<eos>"
  )
  assert _spans(ids, mask, 1) == "<tool>347*29-118</tool>\\boxed{9945}<eos>"
  assert _spans(ids, mask, 0) == "<bos>Compute 347*29-118.\n<obs>9945</obs>"
  # mask boundaries: contiguous action spans exactly
  k_obs = ids.index(TOK.obs_start_id)
  k_obs_end = ids.index(TOK.obs_end_id)
  assert mask[k_obs - 1] == 1 and ids[k_obs - 1] == TOK.tool_end_id
  assert all(m == 0 for m in mask[k_obs : k_obs_end + 1])
  assert mask[k_obs_end + 1] == 1 and ids[-1] == TOK.eos_id and mask[-1] == 1


def test_guess_demo_loss_mask_and_guess_distribution():
  rng = np.random.default_rng(0)
  n_correct = 0
  for _ in range(300):
    ids, mask = make_demo(PROB, False, rng, TOK, p_guess_correct=0.1)
    assert _spans(ids, mask, 0) == "<bos>Compute 347*29-118.\n"
    action = _spans(ids, mask, 1)
    assert action.startswith("\\boxed{") and action.endswith("}<eos>")
    guess = int(extract_boxed(action))
    assert len(str(guess)) in (3, 4, 5)  # same magnitude as 9945
    assert guess > 0
    n_correct += guess == 9945
  assert 10 <= n_correct <= 55  # ~10% of 300
  ids, _ = make_demo(PROB, False, np.random.default_rng(1), TOK, p_guess_correct=1.0)
  assert TOK.decode(ids).endswith("\\boxed{9945}<eos>")
  for seed in range(20):
    ids, _ = make_demo(PROB, False, np.random.default_rng(seed), TOK, p_guess_correct=0.0)
    assert extract_boxed(TOK.decode(ids)) != "9945"


def test_demo_replays_through_env():
  env = ArithToolEnv(TOK)
  for p in make_problems(50, seed=3):
    ids, mask = make_demo(p, True, np.random.default_rng(0), TOK)
    prompt = env.prompt_ids(p)
    assert ids[: len(prompt)] == prompt
    rest, rest_mask = ids[len(prompt) :], mask[len(prompt) :]
    # split into turns at stop tokens; re-run the env and compare
    seq = list(prompt)
    pos, turn, reward = 0, 0, None
    while pos < len(rest):
      end = next(i for i in range(pos, len(rest)) if rest[i] in TOK.stop_ids)
      action = rest[pos : end + 1]
      assert all(rest_mask[pos : end + 1])
      step = env.step(p, turn, action)
      seq += action + step.observation_ids
      pos = end + 1 + len(step.observation_ids)
      turn += 1
      if step.done:
        reward = step.reward
        break
    assert seq == ids and reward == 1.0


def test_make_sft_dataset():
  probs = make_problems(200, seed=1)
  data = make_sft_dataset(probs, p_tool=0.5, seed=7, tokenizer=TOK)
  assert len(data) == 200
  assert data == make_sft_dataset(probs, p_tool=0.5, seed=7, tokenizer=TOK)
  n_tool = sum(TOK.tool_start_id in ids for ids, _ in data)
  assert 60 <= n_tool <= 140
  assert all(TOK.tool_start_id in ids for ids, _ in make_sft_dataset(probs[:20], 1.0, 0, TOK))
  assert not any(TOK.tool_start_id in ids for ids, _ in make_sft_dataset(probs[:20], 0.0, 0, TOK))
  for ids, mask in data:
    assert len(ids) == len(mask) and ids[0] == TOK.bos_id and ids[-1] == TOK.eos_id


# ------------------------------------------------------------------- problems
def test_make_problems_deterministic_and_valid():
  a = make_problems(100, seed=0, split="train")
  assert a == make_problems(100, seed=0, split="train")
  assert a[:10] == make_problems(10, seed=0, split="train")
  assert a != make_problems(100, seed=1, split="train")
  assert len({p.prompt for p in a}) == 100 and len({p.id for p in a}) == 100
  for p in a:
    expr = problem_expression(p)
    assert p.prompt == f"Compute {expr}."
    assert str(safe_eval_arith(expr)) == p.answer
    assert int(p.answer) > 0
  assert len({problem_expression(p).count("*") for p in a}) == 2  # several templates
  with pytest.raises(ValueError):
    make_problems(1, split="test")


def test_train_eval_disjoint():
  train = make_problems(2000, seed=0, split="train")
  ev = make_problems(200, seed=0, split="eval")
  assert len(train) == 2000 and len(ev) == 200
  assert not {p.prompt for p in train} & {p.prompt for p in ev}
  assert all(split_of(problem_expression(p)) == "eval" for p in ev)
  assert all(split_of(problem_expression(p)) == "train" for p in train)
  # disjoint across seeds too (hash partition of the problem space)
  train = {p.prompt for p in make_problems(500, seed=5, split="train")}
  assert not train & {p.prompt for p in ev}


# -------------------------------------------------------------------- MathEnv
def test_math_env():
  env = MathEnv(TOK)
  p = Problem("aime-x", "Find $x$ if $x+1=71$.", "70")
  ids = env.prompt_ids(p)
  assert ids[0] == TOK.bos_id and ids.count(TOK.bos_id) == 1
  assert TOK.decode(ids) == "<bos>Find $x$ if $x+1=71$.\nPut the final answer in \\boxed{}.\n"
  s = env.step(p, 0, enc("x = 70, so \\boxed{70}<eos>"))
  assert s.done and s.reward == 1.0 and s.observation_ids == [] and not s.info["truncated"]
  s = env.step(p, 0, enc("\\boxed{69}<eos>"))
  assert s.done and s.reward == 0.0
  s = env.step(p, 0, enc("\\boxed{70"))
  assert s.done and s.reward == 0.0 and s.info["truncated"]
  s = env.step(Problem("h", "half?", "\\frac{1}{2}"), 0, enc("\\boxed{0.5}<eos>"))
  assert s.reward == 1.0


def test_math_env_generic_tokenizer():
  class WordTok:  # minimal tokenizer: encode/decode/bos_id only, adds bos itself
    bos_id = 0
    vocab = ["<s>"]

    def encode(self, text):
      ids = [0]
      for w in text.split(" "):
        if w not in self.vocab:
          self.vocab.append(w)
        ids.append(self.vocab.index(w))
      return ids

    def decode(self, ids):
      return " ".join(self.vocab[i] for i in ids if i != 0)

  tok = WordTok()
  env = MathEnv(tok)
  p = Problem("a", "What is 7*10?", "70")
  ids = env.prompt_ids(p)
  assert ids[0] == 0 and ids.count(0) == 1
  s = env.step(p, 0, tok.encode("so \\boxed{70}")[1:])
  assert s.done and s.reward == 1.0

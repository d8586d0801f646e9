"""Tests for sao_jax/envs/chain_tool.py (chained calculator calls) and configs/chain_tool.py."""

from __future__ import annotations

import repo_paths  # tests/repo_paths.py
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from sao_jax.data.jsonl import Problem
from sao_jax.data.tokenizer import CharTokenizer
from sao_jax.envs import arith_tool, chain_tool
from sao_jax.envs.chain_tool import ChainToolEnv
from sao_jax.envs.grading import extract_boxed

ROOT = repo_paths.ROOT
TOK = CharTokenizer()
# a=17*23=391, b=391-45=346, c=346*3=1038
PROB = Problem(id="c0", prompt="a=17*23;b=a-45;c=b*3. c?", answer="1038")


def run_episode(env, problem, actions):
  """Replays action texts; returns (reward, observation token count, per-step infos)."""
  n_obs, infos = 0, []
  for turn, a in enumerate(actions):
    st = env.step(problem, turn, TOK.encode(a))
    n_obs += len(st.observation_ids)
    infos.append(st.info)
    if st.done:
      return st.reward, n_obs, infos
  raise AssertionError("episode did not end")


# ------------------------------------------------------------------------ tool
@pytest.mark.parametrize("expr,out", [
    ("17*23", "391"), ("391-45", "346"), (" 346*3 ", "1038"), ("1000+1", "1001"),
    ("17*23-45", "error"),  # two operations in one call
    ("a-45", "error"), ("391", "error"), ("-3*4", "error"), ("3**4", "error"),
    ("7//2", "error"), ("(17*23)", "391"), ("", "error"), (None, "error"), ("17*", "error"),
])
def test_one_op_eval(expr, out):
  assert chain_tool.one_op_eval(expr) == out


def test_scripted_correct_episode_gets_reward_1_and_15_observation_tokens():
  env = ChainToolEnv(TOK, max_turns=5)
  actions = ["<tool>17*23</tool>", "<tool>391-45</tool>", "<tool>346*3</tool>",
             "\\boxed{1038}<eos>"]
  assert chain_tool.demo_actions(PROB, 3, "1038") == actions
  reward, n_obs, infos = run_episode(env, PROB, actions)
  assert reward == 1.0
  # <obs>391</obs> <obs>346</obs> <obs>1038</obs>: 5 + 5 + 6 tokens
  assert n_obs == 16
  assert [i["tool_result"] for i in infos[:3]] == ["391", "346", "1038"]
  assert sum(i["tool_calls"] for i in infos) == 3


def test_long_observation_variant_pads_with_deterministic_noise():
  """task.obs_pad = 100: each observation is <obs> + 100 letters/spaces + '=RESULT' + </obs>
  (3 + 100 + 1 + 3 = 107 tokens for a 3-digit result), the same for the same result, with no
  digit before the result; the reward and the tool results are the plain env's; the demos
  replay through the padded env with loss mask 0 on every observation token."""
  env = ChainToolEnv(TOK, max_turns=5, obs_pad=100)
  actions = chain_tool.demo_actions(PROB, 3, "1038")
  reward, n_obs, infos = run_episode(env, PROB, actions)
  assert reward == 1.0 and [i["tool_result"] for i in infos[:3]] == ["391", "346", "1038"]
  assert n_obs == 16 + 3 * 101
  obs = TOK.decode(env.observation_ids("391"))
  assert obs == TOK.decode(env.observation_ids("391"))  # deterministic
  noise = obs[len("<obs>"):-len("=391</obs>")]
  assert len(noise) == 100 and set(noise) <= set(chain_tool.LOG_CHARS)
  assert obs.endswith("=391</obs>") and noise != chain_tool.log_filler("346", 100)
  ids, mask = chain_tool.make_demo(PROB, 3, "1038", TOK, obs_pad=100)
  assert len(ids) - sum(mask) == len(env.prompt_ids(PROB)) + n_obs
  with pytest.raises(ValueError, match="obs_pad"):
    ChainToolEnv(TOK, obs_pad=-1)


def test_wrong_final_answer_and_compound_call_get_reward_0():
  env = ChainToolEnv(TOK, max_turns=5)
  wrong = ["<tool>17*23</tool>", "<tool>391-45</tool>", "<tool>346*3</tool>",
           "\\boxed{1037}<eos>"]
  assert run_episode(env, PROB, wrong)[0] == 0.0
  st = env.step(PROB, 0, TOK.encode("<tool>17*23-45</tool>"))
  assert TOK.decode(st.observation_ids) == "<obs>error</obs>" and not st.done
  # skipping the chain and guessing right still counts (the reward is the final answer only)
  assert run_episode(env, PROB, ["\\boxed{1038}<eos>"])[0] == 1.0


def test_last_turn_ends_the_episode():
  env = ChainToolEnv(TOK, max_turns=2)
  st = env.step(PROB, 1, TOK.encode("<tool>17*23</tool>"))
  assert st.done and st.reward == 0.0 and st.observation_ids == []


# -------------------------------------------------------------------- problems
def test_problem_generation_is_seeded_and_splits_are_disjoint():
  a = chain_tool.make_problems(300, seed=0, split="train")
  assert a == chain_tool.make_problems(300, seed=0, split="train")
  assert a != chain_tool.make_problems(300, seed=1, split="train")
  ev = chain_tool.make_problems(200, seed=0, split="eval")
  ev1 = chain_tool.make_problems(200, seed=1, split="eval")
  train_prompts = {p.prompt for p in a} | {p.prompt for p in
                                           chain_tool.make_problems(300, 1, "train")}
  assert not train_prompts & ({p.prompt for p in ev} | {p.prompt for p in ev1})
  assert all(arith_tool.split_of(p.prompt) == "eval" for p in ev)
  assert len({p.prompt for p in a}) == 300  # unique within a split


def test_problems_follow_the_chain_and_the_length_mix():
  problems = chain_tool.make_problems(2000, seed=3, split="train")
  lo, hi = chain_tool.VALUE_RANGE
  counts = np.zeros(6)
  for p in problems:
    steps = chain_tool.problem_steps(p)
    value = steps[0][1]
    for op, y in steps[1:]:
      value = int(chain_tool.one_op_eval(f"{value}{op}{y}"))
      assert lo <= value <= hi
    assert str(value) == p.answer
    counts[len(steps) - 1] += 1
  # default weights (0.2, 0.5, 0.3) for 3, 4, 5 calls; binomial sd over 2000 draws <= 0.011
  np.testing.assert_allclose(counts[3:] / counts.sum(), [0.2, 0.5, 0.3], atol=0.04)
  assert counts[:3].sum() == 0


def test_bad_lengths_raise():
  with pytest.raises(ValueError, match="chain_weights"):
    chain_tool.make_problems(3, lengths=(3, 4), weights=(1.0,))
  with pytest.raises(ValueError, match="chain_lengths"):
    chain_tool.make_problems(3, lengths=(0,), weights=(1.0,))
  with pytest.raises(ValueError, match="not a chain problem"):
    chain_tool.problem_steps(Problem(id="x", prompt="Compute 1+2.", answer="3"))


# ------------------------------------------------------------------------- SFT
def split_actions(ids, mask):
  """The action token runs of a demo (maximal runs of loss_mask 1)."""
  runs, cur = [], []
  for t, m in zip(ids, mask):
    if m:
      cur.append(t)
    elif cur:
      runs.append(cur)
      cur = []
  return runs + ([cur] if cur else [])


def test_sft_demos_replay_through_the_env_to_the_reward_they_claim():
  problems = chain_tool.make_problems(400, seed=0, split="train")
  demos = chain_tool.make_sft_dataset(problems, p_tool=0.3, seed=0, tokenizer=TOK,
                                      p_guess_correct=0.1, reliable_calls=3)
  assert demos == chain_tool.make_sft_dataset(problems, p_tool=0.3, seed=0, tokenizer=TOK,
                                              p_guess_correct=0.1, reliable_calls=3)
  problems += chain_tool.make_problems(200, seed=0, split="train", lengths=(5,), weights=(1.0,))
  demos = chain_tool.make_sft_dataset(problems, p_tool=0.3, seed=0, tokenizer=TOK,
                                      p_guess_correct=0.1, reliable_calls=3)
  env = ChainToolEnv(TOK, max_turns=7)
  solved = {3: [], 4: [], 5: []}
  for p, (ids, mask) in zip(problems, demos):
    k = len(chain_tool.problem_steps(p)) - 1
    assert len(ids) == len(mask) <= (128 if k <= 4 else 160)  # fits configs/chain_tool.py
    prompt = env.prompt_ids(p)
    assert ids[:len(prompt)] == prompt and not any(mask[:len(prompt)])
    rebuilt, reward = list(prompt), None
    for turn, action in enumerate(split_actions(ids, mask)):
      st = env.step(p, turn, action)
      rebuilt += action + st.observation_ids
      if st.done:
        reward = st.reward
    assert rebuilt == ids  # the demo is exactly what the env produces for its actions
    text = TOK.decode(ids)
    calls = text.count("</tool>")
    assert calls >= min(k, 3) and "error" not in text
    boxed = extract_boxed(text)
    if calls == k:
      assert boxed == p.answer  # a completed chain boxes the last observation
    assert reward == float(boxed == p.answer)  # the claim: solved iff the box is the answer
    solved[k].append(calls == k)
  assert all(solved[3])  # 3-call chains are always completed by the demonstrator
  # 4 calls: p_tool = 0.3; 5 calls: 0.09 (binomial sd at n ~ 350 / 200: 0.025 / 0.02)
  assert abs(np.mean(solved[4]) - 0.3) < 0.12 and abs(np.mean(solved[5]) - 0.09) < 0.09


def test_make_task_and_config_validate():
  from sao_jax import configs, roles, tasks  # pylint: disable=import-outside-toplevel
  from sao_jax.train.validation import validate_config  # pylint: disable=import-outside-toplevel
  for variant in ("", "smoke"):
    c = configs.load("chain_tool", variant)
    validate_config(c, num_devices=1)
  task = tasks.make_task(roles.from_config(c))
  assert isinstance(task.env, ChainToolEnv) and task.env.max_turns == 7  # 5 calls + answer + 1
  assert len(task.sft_demos) == c.sft.num_demos and len(task.eval_problems) == c.task.n_eval
  assert not {p.prompt for p in task.train_problems} & {p.prompt for p in task.eval_problems}


@pytest.mark.slow
def test_smoke_config_runs_end_to_end(tmp_path):
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  proc = subprocess.run([sys.executable, "-m", "sao_jax.main",
                         "--config=configs/chain_tool.py:smoke",
                         f"--config.run_dir={tmp_path}", "--config.log.progress=off"],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
                        check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "task chain_tool" in proc.stdout and "eval after SAO" in proc.stdout
  records = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  train = [r for r in records if "policy_loss" in r]
  assert [r["step"] for r in train] == [1, 2]
  assert all(np.isfinite(r["explained_variance"]) for r in train)

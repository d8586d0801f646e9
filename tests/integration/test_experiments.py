"""The --quick variants of the four paper-claim experiments (issue 8): each writes its CSV of raw
curves, a PNG and a RESULTS.md section with sane values. The verdicts are not checked here."""

import repo_paths  # tests/repo_paths.py
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = repo_paths.ROOT
sys.path.insert(0, os.path.join(ROOT, "experiments"))

import async_throughput  # noqa: E402
import common  # noqa: E402
import online_style  # noqa: E402
import stability  # noqa: E402
from sao_jax.data.tokenizer import CharTokenizer  # noqa: E402
from sao_jax.envs import arith_tool, chain_tool, style_switch  # noqa: E402


def _check_outputs(out, experiment, arms, metrics, lo=-np.inf, hi=np.inf, section=None):
  rows = common.read_rows(os.path.join(out, f"{experiment}.csv"))
  assert {r["arm"] for r in rows} >= set(arms)
  for m in metrics:
    vals = [r["value"] for r in rows if r["metric"] == m]
    assert vals, m
    assert all(np.isfinite(v) and lo <= v <= hi for v in vals), (m, vals[:5])
  png = os.path.join(out, f"{experiment}.png")
  with open(png, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  md = open(os.path.join(out, "RESULTS.md"), encoding="utf-8").read()
  assert f"<!-- section:{section or experiment} -->" in md and "**Verdict:" in md
  return rows


def test_write_section_replaces_only_its_own_section(tmp_path):
  md = str(tmp_path / "R.md")
  common.write_section(md, "a", "A", "first")
  common.write_section(md, "b", "B", "other")
  common.write_section(md, "a", "A", "second")
  text = open(md).read()
  assert "second" in text and "first" not in text and "other" in text
  assert text.index("## A") < text.index("## B")


def test_apply_overrides_rejects_unknown_field():
  c = common.base_config(True)
  common.apply_overrides(c, {"train.num_steps": 7})
  assert c.train.num_steps == 7
  with pytest.raises(KeyError, match="train.num_stepz"):
    common.apply_overrides(c, {"train.num_stepz": 1})


def test_sync_async_simulation_hand_worked():
  # 2 slots, batch 2, lengths [1, 3, 1, 3], train 2 ticks.
  # sync: step 1 = max(1,3) + 2 = 5; step 2 = 5 more -> t = 10; slot busy = 4 + 4.
  s = async_throughput.simulate_sync(np.array([1, 3, 1, 3]), slots=2, batch_size=2,
                                     train_ticks=2, steps=2)
  np.testing.assert_allclose(s[-1], [10, 4, 8])
  # async (queue 4): t=0 start 1, 3; t=1 slot0 enqueued (q=1), starts 1; t=2 slot0 enqueued
  # (q=2) -> train ticks 2..4, slot0 starts 3; t=3 slot1 enqueued (q=1), starts 1; t=4 step 1
  # done, slot1 enqueued (q=2) -> train 4..6 -> step 2 done at t=6.
  a = async_throughput.simulate_async(np.array([1, 3, 1, 3, 1, 1, 1, 1]), slots=2, batch_size=2,
                                      train_ticks=2, steps=2, queue_size=4)
  np.testing.assert_allclose(a[:, 0], [4, 6])
  assert a[-1, 1] == 4


def test_style_switch_env_rewards_only_the_current_style():
  tok = CharTokenizer()
  env = style_switch.StyleSwitchEnv(arith_tool.ArithToolEnv(tok, max_turns=3),
                                   switch_every_episodes=2)
  p = arith_tool.make_problems(1)[0]
  got = []
  for style in ("", "!", "!", "~", "~", ""):
    ids = tok.encode("\\boxed{" + p.answer + "}" + style) + [tok.eos_id]
    st = env.step(p, 0, ids)
    got.append((st.info["phase"], st.reward))
  assert got == [(0, 1.0), (0, 0.0), (1, 1.0), (1, 0.0), (2, 1.0), (2, 0.0)]
  wrong = env.step(p, 0, tok.encode("\\boxed{1}~") + [tok.eos_id])  # phase 3 = style "", wrong
  assert wrong.reward == 0.0 and wrong.info["correct"] == 0.0


def test_style_task_over_chain_tool_styles_demos_and_grades_eval_without_style():
  """task.style_base=chain_tool: the demos are chain_tool's plus one style character each (all
  three styles present), the training env wraps ChainToolEnv, and the eval env is the base env
  (correctness only, it does not advance the phase counter)."""
  from sao_jax import configs, roles, tasks  # pylint: disable=import-outside-toplevel
  c = configs.load("chain_tool")
  c.task.name, c.task.style_base = "style_switch", "chain_tool"
  c.task.n_train, c.sft.num_demos = 60, 60
  t = tasks.make_task(roles.from_config(c))
  base = configs.load("chain_tool")
  base.task.n_train, base.sft.num_demos = 60, 60
  plain = tasks.make_task(roles.from_config(base)).sft_demos
  tok = t.tokenizer
  seen = set()
  for (ids, mask), (pids, pmask) in zip(t.sft_demos, plain):
    extra = ids[len(pids) - 1:-1]
    assert ids[:len(pids) - 1] == pids[:-1] and ids[-1] == tok.eos_id
    assert mask == pmask[:-1] + [1] * len(extra) + pmask[-1:]
    seen.add(tok.decode(extra))
  assert seen == set(style_switch.STYLES)
  assert isinstance(t.env.base, chain_tool.ChainToolEnv) and t.eval_env is t.env.base
  p = t.train_problems[0]
  ids = tok.encode("\\boxed{" + p.answer + "}!") + [tok.eos_id]
  assert t.eval_env.step(p, 0, ids).reward == 1.0 and t.env.episodes == 0
  st = t.env.step(p, 0, ids)  # phase 0 wants the plain style
  assert (st.reward, st.info["correct"], st.info["style"], t.env.episodes) == (0.0, 1.0, 1, 1)


def test_online_lag_and_switch_steps_hand_worked():
  """Phase k starts at k N + 1; the lag of phase k is the steps from its start until phase k's
  preferred style (style k % 3) is more than half the batch, within the phase; None if never."""
  assert online_style.phase_starts(90, 30) == [31, 61] and online_style.phase_starts(7, 3) == [4, 7]
  steps = np.arange(1, 10)
  # phases: 1-3 (style 0), 4-6 (style 1), 7-9 (style 2)
  f1 = np.array([0.9, 0.9, 0.9, 0.2, 0.5, 0.6, 0.9, 0.9, 0.9])  # > 0.5 first at step 6: lag 2
  f2 = np.array([0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.1, 0.3, 0.5])  # high only before its phase
  fr = {0: np.zeros(9), 1: f1, 2: f2}
  assert online_style.style_lags(steps, fr, [4, 7], 9) == [2, None]
  assert online_style.style_lags(steps, fr, [4, 7], 9, threshold=0.4) == [1, 2]


def test_stability_collapse_rule():
  steps = np.array([10, 20, 30, 40, 50])
  # one dip below half the best (0.8 -> 0.3) then back: not a collapse
  assert stability.collapse_step(steps, np.array([0.2, 0.8, 0.3, 0.7, 0.6])) is None
  # two evals in a row below 0.4: a collapse at the second one
  assert stability.collapse_step(steps, np.array([0.2, 0.8, 0.3, 0.35, 0.9])) == 40
  # low evals before the best is reached are not a collapse (best so far is the reference)
  assert stability.collapse_step(steps, np.array([0.0, 0.05, 0.3, 0.6, 0.8])) is None
  assert stability.collapse_step(steps[:2], np.array([0.05, 0.0])) is None  # best < 0.1


@pytest.mark.slow
def test_throughput_quick(tmp_path):
  async_throughput.run(True, str(tmp_path))
  rows = _check_outputs(str(tmp_path), "async_throughput",
                        ["lognormal/sync", "lognormal/async", "chain_demo/sync"],
                        ["trainer_idle_frac", "rollout_idle_frac"], 0.0, 1.0)
  thr = {(r["arm"], r["seed"]): r["value"] for r in rows
         if r["metric"] == "traj_per_ktick" and r["step"] == 20}
  for seed in async_throughput.SEEDS:  # async never beats the no-idle bound, and beats sync
    assert thr[("lognormal/sync", seed)] < thr[("lognormal/async", seed)]
    assert thr[("lognormal/async", seed)] <= thr[("lognormal/ideal", seed)] * 1.0001


@pytest.mark.slow
def test_training_experiments_quick(tmp_path):
  """stability (sao and grpo_m4 at a fixed delay of 2), ablations (the running-mean arm, 12 steps on
  a pool of 32 prompts at batch 8), stress (one remedy), online, long_horizon (sao and
  grpo_dis at 2 steps, delay 4), real_lm (its pipeline: sao and grpo_dis, 2 steps),
  time_to_accuracy (sao and grpo_sync, 2 steps with tool latency): the tiny model, in one
  subprocess."""
  code = ("import sys; sys.path.insert(0, 'experiments'); import stability, ablations, "
          f"stress, online_style, long_horizon, real_lm, time_to_accuracy; "
          f"out = {str(tmp_path)!r}; "
          "stability.run(True, out); ablations.run(True, out); stress.run(True, out); "
          "online_style.run(True, out); long_horizon.run(True, out); real_lm.run(True, out); "
          "time_to_accuracy.run(True, out)")
  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                        timeout=900, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  out = str(tmp_path)
  rows = _check_outputs(out, "stability_d2", ["sao", "grpo_m4"],
                        ["final_accuracy", "eval_accuracy"], 0.0, 1.0, section="stability")
  assert sorted({r["step"] for r in rows if r["metric"] == "reward_mean"}) == [1, 2]
  # the fixed delay: step 2 trains on tokens sampled 1 version ago (min(d, v) = min(2, 1))
  stale = {(r["arm"], r["step"]): r["value"] for r in rows if r["metric"] == "staleness_mean"}
  assert stale[("sao", 1)] == stale[("grpo_m4", 1)] == 0.0
  assert stale[("sao", 2)] == stale[("grpo_m4", 2)] == 1.0
  # the running-mean window is non-empty for >= 90% of the trajectories after step 10
  rows = _check_outputs(out, "ablations", ["running_mean"], ["final_accuracy"], 0.0, 1.0)
  window = [r["value"] for r in rows
            if r["metric"] == "baseline_nonempty_fraction" and r["step"] > 10]
  assert len(window) == 2 and min(window) >= 0.9, window
  rows = _check_outputs(out, "stress", ["value_bounds"], ["final_accuracy", "value_mean"])
  assert all(r["value"] <= 1.0 + 1e-6 for r in rows if r["metric"] == "value_max")
  _check_outputs(out, "online_style_d1", ["running_mean_128"], ["reward_mean"], 0.0, 1.0,
                 section="online_style")
  md = open(os.path.join(out, "RESULTS.md"), encoding="utf-8").read()
  assert "<!-- section:stability -->" in md and "### Delay d = 2" in md
  # long_horizon: sao and GRPO+DIS (grpo_async with the DIS objective) ran their 2 steps; the
  # eval curve has the warm start (step 0, initial_accuracy), the periodic eval (step 1) and the
  # final eval (step 2)
  rows = _check_outputs(out, "long_horizon", ["sao", "grpo_dis"],
                        ["final_accuracy", "eval_accuracy", "initial_accuracy"], 0.0, 1.0)
  assert {r["arm"] for r in rows} == {"sao", "grpo_dis"}
  for arm in ("sao", "grpo_dis"):
    steps = {m: sorted(r["step"] for r in rows if r["arm"] == arm and r["metric"] == m)
             for m in ("reward_mean", "eval_accuracy", "staleness_mean")}
    assert steps == {"reward_mean": [1, 2], "eval_accuracy": [1, 2], "staleness_mean": [1, 2]}
    # delay 4 at version 1: step 2 trains on tokens 1 version old (min(d, v))
    assert [r["value"] for r in rows if r["arm"] == arm and r["metric"] == "staleness_mean"
            and r["step"] == 2] == [1.0]
  config = os.path.join(out, "runs", "long_horizon", "grpo_dis", "seed0", "config.json")
  assert '"objective": "dis"' in open(config, encoding="utf-8").read()
  assert "| grpo_dis | 0 |" in open(os.path.join(out, "RESULTS.md"), encoding="utf-8").read()
  # real_lm (the pipeline on the tiny model): both arms, a per-run row with its eval curve
  _check_outputs(out, "real_lm", ["sao", "grpo_dis"], ["final_accuracy", "eval_accuracy"],
                 0.0, 1.0)
  section = open(os.path.join(out, "RESULTS.md"), encoding="utf-8").read().split(
      "section:real_lm")[1]
  assert "| sao | 0 |" in section and "quick run: pipeline check only" in section
  # time_to_accuracy: both arms logged the training clock's parts; grpo_sync's barrier gives
  # staleness 0 at every step
  rows = _check_outputs(out, "time_to_accuracy_lognormal", ["sao", "grpo_sync"],
                        ["final_accuracy", "eval_total_s", "warm_start_s", "elapsed_s"], 0.0,
                        1e4,
                        section="time_to_accuracy")
  stale = {(r["arm"], r["step"]): r["value"] for r in rows if r["metric"] == "staleness_mean"}
  assert stale[("grpo_sync", 1)] == stale[("grpo_sync", 2)] == 0.0
  ev = [r["value"] for r in rows if r["metric"] == "eval_total_s" and r["arm"] == "sao"]
  assert len(ev) == 2 and 0 < ev[0] <= ev[1]  # the eval before training, then + the step-1 eval


def test_long_horizon_rule_hand_worked():
  """The pre-set rule: 5/5 positive differences (sign-flip p = 2/32) on both measures = SAO
  ahead; 4/5 = no difference, a match only within 0.05; fewer seeds = incomplete; the DIS
  conclusion follows grpo_dis's verdict; the area is the trapezoid mean."""
  import long_horizon as lh  # pylint: disable=import-outside-toplevel
  up, small = [0.1, 0.2, 0.05, 0.3, 0.1], [0.01, -0.02, 0.03, -0.01, 0.02]
  assert lh.baseline_verdict(up, up, "b") == "SAO ahead of b"
  assert lh.baseline_verdict([-x for x in up], [-x for x in up], "b") == "b ahead of SAO"
  assert lh.baseline_verdict(small, small, "b") == "b matches SAO"
  assert lh.baseline_verdict(up, small, "b") == "mixed/inconclusive"
  assert lh.baseline_verdict([0.2, 0.2, -0.01, 0.2, 0.2], small, "b") == "mixed/inconclusive"
  assert lh.baseline_verdict(up[:4], up[:4], "b").startswith("incomplete")
  assert lh.conclusion({"grpo_dis": "grpo_dis matches SAO"}).endswith(
      "the stability comes from DIS, not from the critic or the single rollout")
  assert lh.conclusion({"grpo_dis": "SAO ahead of grpo_dis"}).startswith("SAO is ahead")
  # steps 0, 25, 50: (0.1 + 0.3) / 2 * 25 + (0.3 + 0.5) / 2 * 25 = 15, over 50 steps = 0.3
  assert common.curve_area(np.array([0, 25, 50]), np.array([0.1, 0.3, 0.5])) == pytest.approx(0.3)
  with pytest.raises(ValueError, match="eval.every_steps"):
    common.curve_area(np.array([0.0]), np.array([0.1]))


def test_stability_direction_rule_hand_worked():
  """The 3-seed direction rule of stability.py and stress.py: 3/3 of one sign on both the final
  accuracy and the area, else no direction; fewer pairs = incomplete. The stated conclusion
  follows grpo_dis's verdicts in both cells; the arms are the ones fixed in the docstring."""
  import stability as st  # pylint: disable=import-outside-toplevel
  up = [0.1, 0.02, 0.3]
  assert st.direction_verdict(up, up, "b", 3) == "SAO ahead of b (3/3)"
  assert st.direction_verdict([-x for x in up], [-x for x in up], "b", 3) == "b ahead of SAO (3/3)"
  assert st.direction_verdict(up, [0.1, -0.01, 0.2], "b", 3) == "no consistent direction"
  assert st.direction_verdict(up, [-x for x in up], "b", 3) == "no consistent direction"
  assert st.direction_verdict(up[:2], up[:2], "b", 3).startswith("incomplete (2 of 3")
  ahead, none = "SAO ahead of grpo_dis (3/3)", "no consistent direction"
  assert st.conclusion({4: {"grpo_dis": ahead}, 8: {"grpo_dis": ahead}}).startswith(
      "SAO is ahead of GRPO+DIS in every cell")
  assert st.conclusion({4: {"grpo_dis": none}, 8: {"grpo_dis": "grpo_dis ahead of SAO (3/3)"}}
                       ).startswith("GRPO+DIS is not behind SAO in any cell")
  assert st.conclusion({4: {"grpo_dis": ahead}, 8: {"grpo_dis": none}}).endswith("mixed")
  assert st.conclusion({4: {"grpo_dis": "incomplete (1 of 3 seeds finished)"}}).startswith(
      "not judged")
  arms = {a.name: a.overrides for a in st.ARMS}
  assert arms["grpo_m4_lr4"]["train.policy_lr"] == pytest.approx(3e-4 / 4)  # chain_tool's lr / 4
  assert arms["grpo_dis"]["train.objective"] == "dis" and arms["grpo_m1"][
      "train.policy_minibatches"] == 1 and arms["grpo_m4"]["train.policy_minibatches"] == 4


def test_paired_test_hand_worked():
  """d = (0.1, 0.2, 0.3): of the 8 sign patterns only all-plus and all-minus reach |mean| 0.2,
  so the exact sign-flip p is 2/8; t = 0.2 / (0.1 / sqrt 3) = 3.464 on 2 degrees of freedom,
  whose two-sided p is 1 - t / sqrt(t^2 + 2) = 0.0742 (the t distribution with 2 df)."""
  s = common.paired_test([0.1, 0.2, 0.3])
  assert (s["n"], s["positive"], s["negative"]) == (3, 3, 0)
  assert s["p_sign_flip"] == pytest.approx(0.25)
  t = 0.2 / (0.1 / np.sqrt(3))
  assert s["p_t"] == pytest.approx(1 - t / np.sqrt(t * t + 2), rel=1e-9)
  assert common.paired_test([0.1, -0.1])["p_sign_flip"] == pytest.approx(1.0)
  with pytest.raises(ValueError):
    common.paired_test([])


def test_study_resumes_from_its_csv_and_refuses_another_setting(tmp_path):
  """The CSV is the study's checkpoint: finished (arm, seed) runs are skipped on a rerun of the
  same setting; a changed setting (or one arm's changed overrides) raises naming what changed;
  an arm added later keeps the finished runs; a run cut short (no final_accuracy row) is not
  counted as finished."""
  csv_path = str(tmp_path / "x.csv")
  setting = {"quick": False, "base": {"train.num_steps": 5}, "arms": {"a": {}, "b": {"k": 1}}}
  assert common._resume_point(csv_path, setting) == set()
  common.append_rows(csv_path, [("x", "a", 0, 5, "final_accuracy", 0.5),
                                ("x", "b", 0, 3, "reward_mean", 0.1),
                                ("x", "a", 1, 5, "final_accuracy", 0.4)])
  assert common._resume_point(csv_path, setting) == {("a", 0), ("a", 1)}
  with pytest.raises(ValueError, match=r"changed: \['base'\]"):
    common._resume_point(csv_path, dict(setting, base={"train.num_steps": 6}))
  with pytest.raises(ValueError, match=r"changed: \['arms.b'\]"):
    common._resume_point(csv_path, dict(setting, arms={"a": {}, "b": {"k": 2}}))
  # an added arm keeps the finished runs and is recorded; an arm left out is only not run now
  grown = dict(setting, arms={"a": {}, "b": {"k": 1}, "c": {"k": 3}})
  assert common._resume_point(csv_path, grown) == {("a", 0), ("a", 1)}
  assert common._resume_point(csv_path, dict(setting, arms={"c": {"k": 3}})) == {("a", 0),
                                                                                ("a", 1)}
  with pytest.raises(ValueError, match=r"changed: \['arms.c'\]"):
    common._resume_point(csv_path, dict(setting, arms={"c": {"k": 4}}))


@pytest.mark.slow
def test_gae_coding_quick(tmp_path):
  """gae_coding --quick: both arms on configs/swe_lite.py:smoke (2 steps) write the CSV with the
  observation-token metric, the plot and a section; a rerun resumes (runs nothing again)."""
  code = ("import sys; sys.path.insert(0, 'experiments'); import gae_coding; "
          f"gae_coding.run(True, {str(tmp_path)!r}); gae_coding.run(True, {str(tmp_path)!r})")
  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                        timeout=900, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  rows = _check_outputs(str(tmp_path), "gae_coding", ["sao", "naive_gae"],
                        ["final_accuracy", "obs_tokens_mean"], 0.0, 1e6)
  assert proc.stdout.count("finished earlier") == 2  # the second call ran nothing
  assert sum(r["metric"] == "final_accuracy" for r in rows) == 2


def test_time_to_accuracy_rule_hand_worked():
  """time_to_accuracy.py: the training clock is elapsed_s - warm_start_s - eval_total_s; TTA is the
  clock of the first eval at or above the target (the warm start excluded), else the run is
  censored and ranks slower than any run that reached it; 5/5 ratios > 1 (sign-flip p = 2/32) =
  faster, 4/5 = no difference; 3 seeds give a direction only."""
  import time_to_accuracy as tta  # pylint: disable=import-outside-toplevel
  rows = [dict(arm="sao", seed=0, step=st, metric=m, value=v) for st, m, v in (
      (0, "initial_accuracy", 0.2), (1, "elapsed_s", 50.0), (1, "eval_total_s", 5.0),
      (1, "rollout_trajectories", 40.0), (5, "elapsed_s", 100.0), (5, "eval_total_s", 5.0),
      (5, "eval_accuracy", 0.3), (10, "elapsed_s", 160.0), (10, "eval_total_s", 12.0),
      (10, "rollout_trajectories", 360.0), (10, "final_accuracy", 0.6),
      (1, "warm_start_s", 3.0), (5, "warm_start_s", 3.0), (10, "warm_start_s", 3.0))]
  steps, ts, acc, (t1, tl, n) = tta.clocks(rows)[("sao", 0)]
  assert steps.tolist() == [0, 5, 10] and ts.tolist() == [0.0, 92.0, 145.0]
  assert acc.tolist() == [0.2, 0.3, 0.6] and (t1, tl, n) == (42.0, 145.0, 320.0)
  assert tta.time_to_target(ts, acc, 0.4) == (145.0, True)
  assert tta.time_to_target(ts, acc, 0.3) == (92.0, True)
  assert tta.time_to_target(ts, acc, 0.7) == (145.0, False)
  assert tta.time_to_target(np.array([0.0, 9.0]), np.array([0.5, 0.1]), 0.4) == (9.0, False)
  assert tta.log_ratio((40.0, True), (20.0, True)) == pytest.approx(np.log(2))
  assert tta.log_ratio((30.0, False), (20.0, True)) == np.inf
  assert tta.log_ratio((10.0, True), (90.0, False)) == -np.inf
  assert tta.log_ratio((30.0, False), (20.0, False)) == 0.0
  up = [0.3, np.inf, 0.1, 0.7, 0.2]
  assert tta.ratio_verdict(up, "sao", "b", 5) == "sao faster than b"
  assert tta.ratio_verdict([-x for x in up], "sao", "b", 5) == "b faster than sao"
  assert tta.ratio_verdict(up[:4] + [-0.1], "sao", "b", 5) == "no difference shown"
  assert tta.ratio_verdict(up[:4], "sao", "b", 5).startswith("incomplete (4 of 5")
  assert tta.ratio_verdict(up[:3], "sao", "b", 3) == "sao faster (3/3)"
  assert tta.ratio_verdict([0.1, -0.2, 0.3], "sao", "b", 3) == "no consistent direction"
  arms = {a.name: a.overrides for a in tta.ARMS}  # grpo_async and grpo_sync differ in mode only
  assert {k: v for k, v in arms["grpo_sync"].items() if k != "train.mode"} == {
      k: v for k, v in arms["grpo_async"].items() if k != "train.mode"}
  assert arms["grpo_sync"]["train.mode"] == "grpo_sync" and arms["sao"] == {}

"""sao_jax.eval: the unbiased pass@k estimator, the summary statistics, and the CLI on a fixture
benchmark (GSM8K format) with a scripted "model" whose correct answers are known."""

import repo_paths  # tests/repo_paths.py
import json
import math
import os
import subprocess
import sys

import pytest

from sao_jax import eval as ev
from sao_jax.data.jsonl import load_math_problems

ROOT = repo_paths.ROOT
BENCH = os.path.join(ROOT, "tests", "data", "gsm8k_test_first6.jsonl")


def _comb_pass_at_k(n, c, k):
  """The estimator written with binomials (Chen et al. 2021, Eq. 1): an independent formula."""
  return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def test_pass_at_k_hand_values():
  assert ev.pass_at_k(4, 2, 2) == pytest.approx(5 / 6, abs=1e-15)  # 1 - C(2,2)/C(4,2) = 1 - 1/6
  assert ev.pass_at_k(16, 1, 1) == pytest.approx(1 / 16, abs=1e-15)
  assert ev.pass_at_k(5, 0, 3) == 0.0
  assert ev.pass_at_k(5, 3, 3) == 1.0  # n - c = 2 < k: every 3-subset has a correct sample
  for n in range(1, 17):
    for c in range(n + 1):
      for k in range(1, n + 1):
        assert ev.pass_at_k(n, c, k) == pytest.approx(_comb_pass_at_k(n, c, k), abs=1e-12)


@pytest.mark.parametrize("args", [(0, 0, 1), (4, 5, 1), (4, 2, 5), (4, 2, 0)])
def test_pass_at_k_rejects_bad_arguments(args):
  with pytest.raises(ValueError, match="k <= n"):
    ev.pass_at_k(*args)


def test_default_ks():
  assert ev.default_ks(16) == [1, 2, 4, 8, 16]
  assert ev.default_ks(1) == [1]
  assert ev.default_ks(6) == [1, 2, 4, 6]


def test_summarize_hand_worked():
  t, f = True, False
  s = ev.summarize({"a": [t, t, t, t], "b": [t, f, t, f], "c": [f, f, f, f]}, [1, 2, 4])
  assert s["problems"] == 3 and s["n"] == 4
  assert s["pass@1"]["mean"] == pytest.approx(0.5)             # (1 + 1/2 + 0) / 3
  assert s["pass@1"]["stderr"] == pytest.approx(0.5 / math.sqrt(3))  # std([1, .5, 0]) = 0.5
  # runs: sample j's accuracy over problems = [2/3, 1/3, 2/3, 1/3]; std (ddof 1) = sqrt(1/27)
  assert s["pass@1"]["stderr_runs"] == pytest.approx(math.sqrt(1 / 27) / 2)
  assert s["pass@2"]["mean"] == pytest.approx((1 + 5 / 6 + 0) / 3)
  assert s["pass@4"]["mean"] == pytest.approx(2 / 3)
  assert s["per_problem"]["b"] == {"n": 4, "correct": 2}
  with pytest.raises(ValueError, match="same number of samples"):
    ev.summarize({"a": [t, f], "b": [t]}, [1])


def test_evaluate_pass_at_k_with_a_scripted_rollout():
  problems = load_math_problems(BENCH)
  correct_on = {problems[0].id: 3, problems[1].id: 0, problems[2].id: 1}  # of n = 3 samples

  def rollout(expanded):
    seen = {}
    out = []
    for p in expanded:
      j = seen.get(p.id, 0)
      seen[p.id] = j + 1
      out.append((p.id, 1.0 if j < correct_on.get(p.id, 0) else 0.0))
    return out[::-1]  # order must not matter

  s = ev.evaluate_pass_at_k(problems[:3], rollout, n=3, ks=[1, 2, 3])
  assert s["pass@1"]["mean"] == pytest.approx((1 + 0 + 1 / 3) / 3)
  assert s["pass@2"]["mean"] == pytest.approx((1 + 0 + (1 - 1 / 3)) / 3)  # 1 - C(2,2)/C(3,2)
  assert s["pass@3"]["mean"] == pytest.approx(2 / 3)
  with pytest.raises(ValueError, match=r"\[1, n=3\]"):
    ev.evaluate_pass_at_k(problems[:3], rollout, n=3, ks=[4])


def _eval_cli(*args, timeout=300):
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  return subprocess.run([sys.executable, "-m", "sao_jax.eval", *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=timeout, check=False)


@pytest.mark.slow
def test_cli_scripted_model_gives_exact_pass_at_k(tmp_path):
  """The scripted model always answers problems 0, 2, 3 correctly, never 1 and 4, and problem 5
  on 1 of its 4 samples: pass@1 = 3.25/6, pass@2 = (3 + 1/2)/6, pass@4 = 4/6 exactly."""
  problems = load_math_problems(BENCH)
  n = 4
  lines = []
  for i, p in enumerate(problems):
    for j in range(n):
      right = i in (0, 2, 3) or (i == 5 and j == 2)
      ans = p.answer if right else str(int(p.answer) + 1)
      lines.append({"id": p.id, "response": f"Let me think. The answer is \\boxed{{{ans}}}."})
  resp = tmp_path / "responses.jsonl"
  resp.write_text("\n".join(json.dumps(l) for l in lines) + "\n")
  out = tmp_path / "result.json"
  proc = _eval_cli("--config=configs/aime.py", f"--benchmark={BENCH}", f"--responses={resp}",
                   f"--n={n}", "--k=1,2,4", f"--out={out}")
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  s = json.loads(out.read_text())
  assert s["problems"] == 6 and s["n"] == 4
  assert s["pass@1"]["mean"] == pytest.approx(3.25 / 6, abs=1e-12)
  assert s["pass@2"]["mean"] == pytest.approx(3.5 / 6, abs=1e-12)   # 1 - C(3,2)/C(4,2) = 1/2
  assert s["pass@4"]["mean"] == pytest.approx(4 / 6, abs=1e-12)
  per = [1, 0, 1, 1, 0, 0.25]
  mean = sum(per) / 6
  sd = math.sqrt(sum((x - mean) ** 2 for x in per) / 5)
  assert s["pass@1"]["stderr"] == pytest.approx(sd / math.sqrt(6), abs=1e-12)
  assert [s["per_problem"][p.id]["correct"] for p in problems] == [4, 0, 4, 4, 0, 1]
  assert "pass@1" in proc.stdout and "54.17%" in proc.stdout  # 3.25 / 6


@pytest.mark.slow
def test_cli_engine_path_runs_a_model(tmp_path):
  """Sampling through the trainer's engine path (random tiny model: every answer wrong)."""
  out = tmp_path / "r.json"
  proc = _eval_cli("--config=configs/arith_tool.py:smoke", "--limit=3", "--n=2",
                   f"--out={out}")
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  s = json.loads(out.read_text())
  assert s["problems"] == 3 and s["n"] == 2 and s["benchmark"] == "arith_tool_heldout"
  assert sum(v["n"] for v in s["per_problem"].values()) == 6
  assert 0.0 <= s["pass@1"]["mean"] <= s["pass@2"]["mean"] <= 1.0


@pytest.mark.slow
def test_cli_rejects_top_p():
  proc = _eval_cli("--config=configs/aime.py", "--top_p=0.9", timeout=120)
  assert proc.returncode != 0 and "top_p" in proc.stderr


# ---- the paper's protocol ----------------------------------------------------------------------
def test_protocol_table_hand_values():
  t, f = True, False
  s = ev.summarize({"a": [t, t, f, f], "b": [t, f, f, f]}, [1])  # 3/8 = 37.5%
  row = dict(s, title="AIME 2025", tool_calls=1.5, turns=2.25)
  lines = ev.format_protocol_table([row]).splitlines()
  assert lines[0].split()[:4] == ["benchmark", "problems", "samples", "mean"]
  # s.e. over problems: std([.5, .25], ddof 1) / sqrt(2) = 0.125; runs: acc_j = [1, .5, 0, 0]
  runs_se = 100 * math.sqrt(sum((x - 0.375) ** 2 for x in [1, .5, 0, 0]) / 3) / 2
  assert lines[2].split() == ["AIME", "2025", "2", "4", "37.50%", "12.50", f"{runs_se:.2f}",
                              "1.50", "2.25"]


@pytest.mark.slow
def test_cli_paper_protocol_on_a_tiny_random_model(tmp_path):
  """--protocol=paper: the four benchmarks, 16/16/4/16 samples per problem (here 1 problem each),
  multi-turn tir_math episodes through the engine, the per-benchmark table printed."""
  out = tmp_path / "p.json"
  proc = _eval_cli("--config=configs/aime.py:smoke", "--protocol=paper", "--limit=1",
                   "--max_new_tokens=8", f"--out={out}")
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  s = json.loads(out.read_text())
  assert s["protocol"] == "paper"
  rows = s["benchmarks"]
  assert [(r["title"], r["problems"], r["n"]) for r in rows] == [
      ("AIME 2025", 1, 16), ("HMMT Feb 2025", 1, 16), ("BeyondAIME", 1, 4),
      ("IMO-AnswerBench", 1, 16)]
  for r in rows:
    assert r["temperature"] == 1.0 and r["top_p"] == 1.0
    assert sum(v["n"] for v in r["per_problem"].values()) == r["n"]
    assert 0.0 <= r["pass@1"]["mean"] <= 1.0 and r["turns"] >= 1.0
  assert "temperature 1.0, top-p 1.0, tir_math (max 4 turns)" in proc.stdout
  assert "NOT the full protocol: --limit=1" in proc.stdout
  for title in ("AIME 2025", "HMMT Feb 2025", "BeyondAIME", "IMO-AnswerBench"):
    assert any(l.startswith(title) for l in proc.stdout.splitlines()), title


@pytest.mark.slow
def test_cli_paper_protocol_fixes_the_temperature():
  proc = _eval_cli("--config=configs/aime.py:smoke", "--protocol=paper", "--temperature=0.6",
                   timeout=120)
  assert proc.returncode != 0 and "temperature 1.0" in proc.stderr


@pytest.mark.slow
def test_warm_start_checkpoint_is_the_cached_sft_policy(tmp_path):
  """``--checkpoint=warm_start`` evaluates the policy ``sao_jax.main`` starts RL from: with the
  SFT cached, ``load_params`` returns those exact arrays (no second SFT run); a task without
  demonstrations is refused by name."""
  import numpy as np
  import jax
  from sao_jax import build, configs, roles, tasks

  def same(a, b):
    return all(jax.tree.leaves(jax.tree.map(
        lambda x, y: bool(np.array_equal(np.asarray(x), np.asarray(y))), a, b)))

  cfg = configs.load("arith_tool", "smoke")
  cfg.sft.steps, cfg.sft.cache_dir = 3, str(tmp_path / "sft")
  run = roles.from_config(cfg)
  task = tasks.make_task(run)
  policy = build.build_policy(run, task)          # trains and writes the cache
  mcfg, loaded = ev.load_params(run, ev.WARM_START, task.tokenizer.vocab_size, task)
  assert mcfg == policy.mcfg and same(policy.params, loaded)
  init = ev.load_params(run, "", task.tokenizer.vocab_size)[1]  # the random init SFT began at
  assert not same(policy.params, init)
  task.sft_demos = []
  with pytest.raises(ValueError, match="warm_start: this task has no SFT demonstrations"):
    ev.load_params(run, ev.WARM_START, task.tokenizer.vocab_size, task)

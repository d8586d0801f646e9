"""The generated coding task (``sao_jax/envs/swe_lite.py``): instances split by module, every
mutant fails its FAIL_TO_PASS tests and its gold patch resolves it, demonstrations of whole
episodes solve a minority and have long observations, and ``configs/swe_lite.py:smoke`` /
``configs/swe.py:smoke`` run end to end."""

import repo_paths  # tests/repo_paths.py
import collections
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from sao_jax import configs, roles, tasks
from sao_jax.data import swebench
from sao_jax.data.tokenizer import CharTokenizer
from sao_jax.envs import swe_lite, swe_lite_gen
from sao_jax.envs.sandbox import SandboxLimits
from sao_jax.envs.swe_lite_modules import MODULES
from sao_jax.envs.workspace import SandboxBackend, WorkspaceEnv, grade
from sao_jax.train import metric_defs

ROOT = repo_paths.ROOT
TOK = CharTokenizer()
BACKEND = SandboxBackend(SandboxLimits(cpu_s=2, wall_s=10.0), test_timeout_s=2.0, cache_size=64)
CASES = {name: cases for name, _, cases in MODULES}
SOURCES = {name: src for name, src, _ in MODULES}


@pytest.fixture(scope="module")
def instances():
  return {s: swe_lite.make_instances(s, seed=0) for s in ("train", "eval")}


def test_split_by_module_with_at_least_100_held_out_instances(instances):
  train, evals = instances["train"], instances["eval"]
  assert len(evals) >= 100 and len(train) >= 250
  mods = {s: {i.meta["module"] for i in v} for s, v in instances.items()}
  assert not mods["train"] & mods["eval"]
  assert set(collections.Counter(i.meta["kind"] for i in evals)) == set(swe_lite.KINDS)
  assert len({i.instance_id for i in train + evals}) == len(train) + len(evals)
  # deterministic in the seed, and the seed only reorders
  again = swe_lite.make_instances("eval", seed=0)
  assert [i.instance_id for i in again] == [i.instance_id for i in evals]
  other = swe_lite.make_instances("eval", seed=1)
  assert sorted(i.instance_id for i in other) == sorted(i.instance_id for i in evals)


def test_every_mutant_fails_its_fail_to_pass_cases_and_the_fix_restores_the_module(instances):
  for inst in instances["train"] + instances["eval"]:
    name = inst.meta["module"]
    broken = inst.files[f"{name}.py"]
    ok = swe_lite._cases_pass(broken, name, CASES[name])  # pylint: disable=protected-access
    f2p = [f"tests/test_{name}.py::test_{k + 1}" for k, o in enumerate(ok) if not o]
    assert list(inst.fail_to_pass) == f2p and f2p
    assert len(inst.fail_to_pass) + len(inst.pass_to_pass) == len(CASES[name])
    assert broken.count(inst.meta["fix_old"]) == 1
    assert broken.replace(inst.meta["fix_old"], inst.meta["fix_new"]) == SOURCES[name]
    # visible tests: every case but the last; the hidden file has them all
    assert inst.files[f"tests/test_{name}.py"].count("def test_") == len(CASES[name]) - 1
    assert inst.test_files[f"tests/test_{name}.py"].count("def test_") == len(CASES[name])


def test_gold_patch_resolves_in_the_sandbox_and_the_mutant_does_not(instances):
  for inst in instances["eval"][:3]:
    assert grade(inst, dict(inst.files), BACKEND)[0] == 0.0
    gold = swebench.gold_files(inst)
    assert gold[f"{inst.meta['module']}.py"] == SOURCES[inst.meta["module"]]
    assert grade(inst, gold, BACKEND)[0] == 1.0


def test_mutations_and_fix_edit_on_a_hand_example():
  src = "def f(x):\n  if x < 0:\n    return 0\n  return x + 1\n"
  muts = dict((m, k) for k, m in swe_lite.mutants(src))
  assert muts["def f(x):\n  if x <= 0:\n    return 0\n  return x + 1\n"] == "comparison"
  assert muts["def f(x):\n  if x < 0:\n    return 0\n  return x - 1\n"] == "operator"
  assert muts["def f(x):\n  if x < 1:\n    return 0\n  return x + 1\n"] == "off_by_one"
  assert muts["def f(x):\n  return x + 1\n"] == "missing_edge_case"
  assert swe_lite.fix_edit("def f(x):\n  return x + 1\n", src) == (
      "def f(x):", "def f(x):\n  if x < 0:\n    return 0")
  assert swe_lite.fix_edit("a\nb\na\n", "a\nc\na\n") == ("b", "c")
  # line-addressed: the changed token, widened until unique in its line
  assert swe_lite.fix_edit_in_line(src.replace("x < 0", "x <= 0"), src) == (2, "<=", "<")
  assert swe_lite.fix_edit_in_line(src.replace("x + 1", "x - 1"), src) == (4, "-", "+")
  assert swe_lite.fix_edit_in_line("  r = range(1, n + 1)", "  r = range(2, n + 1)") == (
      1, "(1", "(2")
  assert swe_lite.fix_edit_in_line("  return a or x < b", "  return a or x <= b") == (
      1, "<", "<=")
  assert swe_lite.fix_edit_in_line("  f(x <= 1) or x < 2", "  f(x <= 1) or x <= 2") == (
      1, " x <", " x <=")
  assert swe_lite.fix_edit_in_line("def f(x):\n  return x + 1\n", src) is None  # two lines


def test_generated_modules_hold_their_cases_and_give_held_out_instances_of_the_chosen_kinds():
  mods = swe_lite_gen.generate(120)
  assert mods == swe_lite_gen.generate(120) and mods != swe_lite_gen.generate(120, seed=1)
  assert len({name for name, _, _ in mods}) == 120
  assert not {name for name, _, _ in mods} & set(SOURCES)
  for name, source, cases in mods:
    assert len(cases) == 5 and all(swe_lite._cases_pass(source, name, cases))  # pylint: disable=protected-access
    assert "while" not in source and source.startswith(f"def {name}(")
  kinds = ("comparison", "operator")
  evals = swe_lite.make_instances("eval", generated=120, kinds=kinds)
  train = swe_lite.make_instances("train", generated=120, kinds=kinds)
  assert {i.meta["kind"] for i in evals + train} == set(kinds) and len(evals) >= 100
  assert not {i.meta["module"] for i in train} & {i.meta["module"] for i in evals}
  for inst in evals[:40]:  # a generated mutant fails a case and its gold fix restores it
    name, cases = inst.meta["module"], [tuple(c) for c in inst.meta["cases"]]
    broken = inst.files[f"{name}.py"]
    assert not all(swe_lite._cases_pass(broken, name, cases))  # pylint: disable=protected-access
    fixed = broken.replace(inst.meta["fix_old"], inst.meta["fix_new"], 1)
    assert all(swe_lite._cases_pass(fixed, name, cases))  # pylint: disable=protected-access
  with pytest.raises(ValueError, match="task.swe_kinds"):
    swe_lite.make_instances("eval", kinds=("typo",))
  with pytest.raises(ValueError, match="task.swe_generated"):
    swe_lite_gen.generate(-1)


def test_demonstrations_solve_a_minority_and_have_long_observations(instances):
  train = instances["train"][:12]
  env = WorkspaceEnv(TOK, train, max_turns=8, backend=BACKEND, system=swe_lite.SYSTEM)
  rng = np.random.default_rng(0)
  rewards, obs = {}, []
  for inst, kind in zip(train, ["fix", "retry", "wrong", "give_up"] * 3):
    actions = swe_lite.demo_actions(inst, kind, rng)
    if kind == "retry" and inst.meta["kind"] != "missing_edge_case":  # wrong edit, undo, fix
      assert [a.split()[0][3:] for a in actions] == [
          "view", "test", "replace", "test", "undo", "replace", "test", "finish"]
      assert actions[5].startswith(f"```replace {inst.meta['module']}.py ")  # line-addressed fix
    ids, mask, r = swe_lite.make_demo(env, inst, actions)
    rewards.setdefault(kind, []).append(r)
    prompt = len(env.prompt_ids(env.problems()[0]))
    obs.append(len(ids) - sum(mask) - len(env.prompt_ids(
        next(p for p in env.problems() if p.id == inst.instance_id))))
    assert len(ids) == len(mask) and prompt > 0
  assert rewards == {"fix": [1.0] * 3, "retry": [1.0] * 3, "wrong": [0.0] * 3,
                     "give_up": [0.0] * 3}
  print(f"observation tokens per demonstration: mean {np.mean(obs):.0f}, min {min(obs)}")
  assert min(obs) >= 100
  demos = swe_lite.make_sft_dataset(env, train, p_fix=0.3, seed=0, num_demos=12)
  assert len(demos) == 12 and all(len(i) == len(m) for i, m in demos)
  with pytest.raises(ValueError, match="sft.p_tool"):
    swe_lite.make_sft_dataset(env, train, p_fix=1.5, seed=0)
  with pytest.raises(ValueError, match="demo kind"):
    swe_lite.demo_actions(train[0], "patch", rng)


def test_batch_metrics_count_observation_tokens_after_the_prompt():
  traj = collections.namedtuple("T", "action_mask")
  trajs = [traj(np.array([0, 0, 0, 1, 1, 0, 0, 1], np.float32)),   # prompt 3, obs 2
           traj(np.array([0, 0, 1, 0, 0, 0, 0, 1], np.float32))]   # prompt 2, obs 4
  assert swe_lite.batch_metrics(trajs) == {"obs_tokens_mean": 3.0}
  assert metric_defs.describe("obs_tokens_mean").unit == "tokens"


def test_swe_task_needs_instances_and_reads_swe_bench_jsonl(tmp_path, instances):
  c = configs.load("swe", "smoke")
  c.task.train_file = ""
  with pytest.raises(ValueError, match="task.train_file"):
    tasks.make_task(roles.from_config(c))
  path = tmp_path / "inst.jsonl"
  swebench.write_instances(path, instances["eval"][:6])
  c.task.train_file, c.task.eval_file, c.task.n_eval = str(path), "", 2
  task = tasks.make_task(roles.from_config(c))
  assert [p.id for p in task.eval_problems] == [i.instance_id for i in instances["eval"][4:6]]
  assert len(task.train_problems) == 4 and task.sft_demos is None
  run = roles.from_config(configs.load("swe"))
  assert (run.train.eps_low, run.train.eps_high) == (0.8, 3.0)


def _smoke(config, tmp_path):
  run_dir = str(tmp_path / "run")
  proc = subprocess.run([sys.executable, "-m", "sao_jax.main", f"--config={config}",
                         f"--config.run_dir={run_dir}"], cwd=ROOT, capture_output=True, text=True,
                        timeout=900, check=False, env=dict(os.environ, PYTHONUNBUFFERED="1"))
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  rows = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl"))]
  for key in {k for r in rows for k in r} - {"step"}:
    metric_defs.describe(key)  # every logged name is in the vocabulary
  steps = [r for r in rows if "obs_tokens_mean" in r]
  assert len(steps) == 2 and all(r["obs_tokens_mean"] >= 0 for r in steps)
  assert "final/eval_accuracy" in rows[-1]
  assert "greedy, hidden tests pass: resolved rate)" in proc.stdout  # the table names the grader
  print(config, "observation tokens per trajectory:", [r["obs_tokens_mean"] for r in steps])
  return rows


@pytest.mark.slow
def test_swe_lite_smoke_runs_end_to_end(tmp_path):
  _smoke("configs/swe_lite.py:smoke", tmp_path)


@pytest.mark.slow
def test_swe_smoke_runs_end_to_end(tmp_path):
  _smoke("configs/swe.py:smoke", tmp_path)

"""Config and data validation: every bad field named with its fix, before anything is built."""

import repo_paths  # tests/repo_paths.py
import importlib.util
import os
import subprocess
import sys

import ml_collections
import pytest

from sao_jax.train import validation
from sao_jax.train.validation import ConfigError, validate_config
from sao_jax.data.jsonl import load_math_problems

ROOT = repo_paths.ROOT


def _config(name="arith_tool", variant=""):
  spec = importlib.util.spec_from_file_location(f"cfg_{name}", os.path.join(ROOT, "configs",
                                                                            f"{name}.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config(variant)


@pytest.mark.parametrize("name,variant", [("arith_tool", ""), ("arith_tool", "smoke"),
                                          ("aime", "smoke"), ("gsm8k_smollm2", ""),
                                          ("gsm8k_smollm2", "smoke"),
                                          ("chain_tool", "long_obs"),
                                          ("smollm2_arith", "compare")])
def test_shipped_configs_are_valid(name, variant):
  validate_config(_config(name, variant), num_devices=1)


def test_aime_is_valid_once_given_its_checkpoint(tmp_path):
  c = _config("aime")
  with pytest.raises(ConfigError) as ei:
    validate_config(c, num_devices=1)
  assert [p.split(" = ")[0] for p in ei.value.problems] == ["config.model.checkpoint_dir"]
  (tmp_path / "config.json").write_text('{"model_type": "qwen3"}')  # a Hugging Face folder
  c.model.checkpoint_dir = str(tmp_path)
  validate_config(c, num_devices=1)


def _set(c, field, value):
  group, key = field.split(".")
  c[group][key] = value


# one bad value per enum field: every enum field of the schema is listed here
BAD_ENUMS = {
    "train.mode": "ppo",
    "train.objective": "ppo",
    "train.advantage_estimator": "gae",
    "train.aggregation": "avg",
    "rollout.kv_on_update": "sometimes",
    "rollout.staleness_policy": "drop+admission",
    "rollout.backend": "k8s",
    "rollout.weight_sync": "carrier_pigeon",
    "rollout.prefill_rows": "some",
    "model.dtype": "float8",
    "model.param_dtype": "int8",
    "model.remat": "full",
    "task.name": "chess",
    "task.style_base": "math",
    "log.progress": "fancy",
    "distributed.cpu_collectives": "nccl",
}


def test_every_enum_field_is_covered_and_its_defaults_are_allowed():
  choices = validation.enum_choices()
  assert set(choices) == set(BAD_ENUMS)
  c = _config()
  for field, allowed in choices.items():
    group, key = field.split(".")
    assert c[group][key] in allowed, field
  assert choices["train.mode"] == ("sao", "vapo", "grpo_async", "grpo_sync")
  assert choices["train.objective"] == ("auto", "dis", "ppo_clip", "tis", "icepop", "reinforce")
  assert choices["rollout.staleness_policy"] == ("none", "admission", "drop", "admission+drop")
  assert choices["log.progress"] == ("auto", "bar", "lines", "off")
  assert set(choices["train.advantage_estimator"]) == {
      "auto", "skip_obs_gae", "naive_gae", "step_gae_mean", "step_gae_last", "grpo",
      "grpo_no_std", "running_mean_prompt", "running_mean_global"}


@pytest.mark.parametrize("field", sorted(BAD_ENUMS))
def test_bad_enum_value_is_refused_naming_the_field(field):
  c = _config()
  _set(c, field, BAD_ENUMS[field])
  with pytest.raises(ConfigError) as ei:
    validate_config(c, num_devices=1)
  assert len(ei.value.problems) == 1, ei.value.problems
  assert ei.value.problems[0].startswith(f"config.{field} = {BAD_ENUMS[field]!r}: must be one of ")
  assert "; fix: use " in ei.value.problems[0]


def test_enum_fix_suggests_the_closest_value():
  c = _config()
  c.train.objective, c.rollout.kv_on_update = "ppo_clp", "recompte"
  with pytest.raises(ConfigError) as ei:
    validate_config(c, num_devices=1)
  assert "config.train.objective = 'ppo_clp': must be one of" in str(ei.value)
  assert "fix: use 'ppo_clip'" in str(ei.value) and "fix: use 'recompute'" in str(ei.value)


def test_every_enum_value_is_accepted_with_a_compatible_mode():
  for field, allowed in validation.enum_choices().items():
    for value in allowed:
      c = _config()
      _set(c, field, value)
      if field == "train.advantage_estimator" and value.startswith("grpo"):
        c.train.mode = "grpo_async"
      if field == "train.aggregation" and value == "sum_norm":
        c.train.loss_norm_constant = 48
      if field == "task.name" and value == "math":
        c.task.train_file = "aime25.jsonl"
      validate_config(c, num_devices=1)


def test_estimator_names_read_the_registry_when_there_is_one(monkeypatch):
  from sao_jax import algo  # pylint: disable=import-outside-toplevel
  assert validation.estimator_names() == tuple(algo.ESTIMATORS)
  monkeypatch.setattr(algo, "ESTIMATORS", {"skip_obs_gae": None, "my_estimator": None},
                      raising=False)
  assert validation.estimator_names() == ("skip_obs_gae", "my_estimator")
  c = _config()
  c.train.advantage_estimator = "my_estimator"
  validate_config(c, num_devices=1)
  c.train.advantage_estimator = "naive_gae"
  with pytest.raises(ConfigError, match="config.train.advantage_estimator = 'naive_gae'"):
    validate_config(c, num_devices=1)


# a representative out-of-range value for every range rule: (field, value, message prefix)
OUT_OF_RANGE = [
    ("seed", -1, "must be >= 0"),
    ("train.ppo_eps_low", 1.0, "must be in [0, 1)"),
    ("train.ppo_eps_high", 0.0, "must be > 0"),
    ("train.dual_clip", 0.5, "must be 0 (off) or > 1"),
    ("train.tis_cap", 0.0, "must be > 0"),
    ("train.icepop_low", 1.0, "must be in [0, 1)"),
    ("train.icepop_high", 1.0, "must be > 1 and > train.icepop_low"),
    ("train.entropy_coef", -0.01, "must be >= 0"),
    ("train.kl_coef", -0.1, "must be >= 0"),
    ("train.loss_norm_constant", -1, "must be >= 0"),
    ("train.batch_size", 0, "must be >= 1"),
    ("train.group_size", 0, "must be >= 1"),
    ("train.num_steps", 0, "must be >= 1"),
    ("train.policy_lr", 0.0, "must be > 0"),
    ("train.critic_lr", -1e-3, "must be > 0"),
    ("train.critic_lr_warmup_steps", -1, "must be >= 0"),
    ("train.critic_warmup_steps", -1, "must be >= 0"),
    ("train.lam_alpha", 0.0, "must be > 0"),
    ("train.lam_critic", 1.5, "must be in [0, 1]"),
    ("train.lam_critic", -0.1, "must be in [0, 1]"),
    ("train.value_clip_eps", -0.2, "must be >= 0"),
    ("train.max_grad_norm", 0.0, "must be > 0"),
    ("train.lam_policy", "1.5", "must be 'adaptive' or a number in [0, 1]"),
    ("train.baseline_window", 0, "must be >= 1"),
    ("train.global_baseline_window", 0, "must be >= 1"),
    ("train.max_consecutive_nonfinite", 0, "must be >= 1"),
    ("train.critic_frozen_patterns", ("/attn/", "(unclosed"), "must be a tuple of valid regular"),
    ("model.head_dim", 33, "must be even"),
    ("model.rope_theta", 0.0, "must be > 0"),
    ("model.d_model", 0, "must be >= 1"),
    ("model.max_seq_len", 0, "must be >= 1"),
    ("rollout.num_workers", 0, "must be >= 1"),
    ("rollout.slots", 0, "must be >= 1"),
    ("rollout.queue_size", 0, "must be >= 1"),
    ("rollout.decode_steps", 0, "must be >= 1"),
    ("rollout.env_timeout_s", 0.0, "must be > 0"),
    ("task.max_turns", 0, "must be >= 1"),
    ("task.n_eval", 0, "must be >= 1"),
    ("sft.steps", -1, "must be >= 0"),
    ("sft.lr", 0.0, "must be > 0"),
    ("sft.num_demos", -1, "must be >= 0"),
    ("sft.p_tool", 1.5, "must be in [0, 1]"),
    ("eval.every_steps", -1, "must be >= 0"),
    ("eval.periodic_problems", 0, "must be >= 1"),
    ("checkpoint.every_steps", -1, "must be >= 0"),
    ("checkpoint.max_to_keep", 0, "must be >= 1"),
    ("mesh.tokens_per_device", -8, "must be >= 0"),
    ("distributed.num_processes", 0, "must be -1 (from the environment) or >= 1"),
    ("distributed.process_id", -2, "must be -1 (from the environment) or in [0, "),
]


@pytest.mark.parametrize("field,value,what", OUT_OF_RANGE,
                         ids=[f"{f}={v!r}" for f, v, _ in OUT_OF_RANGE])
def test_out_of_range_value_is_refused_naming_the_field(field, value, what):
  c = _config()
  if "." in field:
    _set(c, field, value)
  else:
    c[field] = value
  with pytest.raises(ConfigError) as ei:
    validate_config(c, num_devices=1)
  mine = [p for p in ei.value.problems if p.startswith(f"config.{field} = {value!r}: ")]
  assert mine, ei.value.problems
  assert mine[0].startswith(f"config.{field} = {value!r}: {what}") and "; fix: " in mine[0]


# cross-field rules: (overrides, the field named, message part)
CROSS_FIELD = [
    ({"train.mode": "grpo_async", "train.group_size": 1}, "train.group_size",
     "must be >= 2 in train.mode='grpo_async'"),
    ({"train.mode": "grpo_sync", "train.group_size": 6}, "train.batch_size",
     "must be a multiple of train.group_size (6)"),
    ({"train.advantage_estimator": "grpo"}, "train.advantage_estimator",
     "the grpo estimators normalise over groups"),
    ({"train.advantage_estimator": "grpo_no_std", "train.mode": "vapo"},
     "train.advantage_estimator", "which train.mode='vapo' does not make"),
    ({"train.aggregation": "sum_norm"}, "train.aggregation",
     "needs train.loss_norm_constant > 0"),
    ({"rollout.staleness_policy": "drop", "rollout.max_staleness": -1},
     "rollout.staleness_policy", "needs rollout.max_staleness >= 0"),
    ({"rollout.lockstep_delay": 4}, "rollout.lockstep_delay",
     "a fixed rollout delay needs the lockstep rollout"),
    ({"train.dual_clip": 3.0}, "train.dual_clip", "resolves to 'dis' here"),
    ({"rollout.num_workers": 4}, "rollout.num_workers", "needs rollout.backend='ray'"),
    ({"rollout.ray_address": "head:6379"}, "rollout.ray_address",
     "is read only by rollout.backend='ray'"),
    ({"task.name": "math"}, "task.train_file", "reads its prompts from this JSONL file"),
    ({"distributed.num_processes": 2, "distributed.process_id": 2}, "distributed.process_id",
     "in [0, distributed.num_processes)"),
    ({"train.icepop_low": 0.9, "train.icepop_high": 0.8}, "train.icepop_high",
     "must be > 1 and > train.icepop_low"),
]


@pytest.mark.parametrize("overrides,field,what", CROSS_FIELD,
                         ids=[f for _, f, _ in CROSS_FIELD])
def test_cross_field_rule_names_the_field(overrides, field, what):
  c = _config()
  for k, v in overrides.items():
    _set(c, k, v)
  with pytest.raises(ConfigError) as ei:
    validate_config(c, num_devices=1)
  mine = [p for p in ei.value.problems if p.startswith(f"config.{field} = ")]
  assert len(mine) == 1 and what in mine[0] and "; fix: " in mine[0], ei.value.problems


def test_cross_field_rules_accept_the_consistent_settings():
  c = _config()
  c.train.lam_policy = "0.95"  # what --config.train.lam_policy=0.95 gives (a str field)
  c.train.mode, c.train.group_size, c.train.batch_size = "grpo_sync", 8, 32
  c.train.objective, c.train.dual_clip = "tis", 3.0
  c.train.aggregation, c.train.loss_norm_constant = "sum_norm", 48
  c.rollout.staleness_policy, c.rollout.max_staleness = "admission+drop", 0
  c.rollout.backend, c.rollout.num_workers = "ray", 4
  c.rollout.ray_address = "head:6379"
  c.distributed.num_processes, c.distributed.process_id = 2, 1
  validate_config(c, num_devices=1)
  c = _config()
  c.rollout.lockstep, c.train.group_size = True, 8  # sao ignores group_size: 1 rollout/prompt
  validate_config(c, num_devices=1)
  c.train.mode, c.rollout.lockstep_delay = "grpo_async", 4  # lockstep groups, fixed delay
  validate_config(c, num_devices=1)


def test_a_bad_type_is_reported_once_not_again_by_the_rules_that_read_it():
  c = _config()
  c.train.mode, c.train.group_size = "grpo_async", 8
  d = c.to_dict()
  d["train"]["group_size"] = "8"
  with pytest.raises(ConfigError) as ei:
    validate_config(ml_collections.ConfigDict(d), num_devices=1)
  assert ei.value.problems == ["config.train.group_size = '8': wrong type str; fix: give a int"]


def test_a_multi_process_job_starts_no_jax_backend_before_distributed_initialize(monkeypatch):
  c = _config()
  c.distributed.coordinator_address = "localhost:1234"
  c.train.batch_size = 31  # would not split over 2 devices: left to the trainer here
  import jax  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(jax, "device_count", lambda: pytest.fail("jax.device_count was called"))
  validate_config(c)


@pytest.mark.parametrize("field,value,needle", [
    ("train.eps_low", 1.0, "config.train.eps_low = 1.0: must be in [0, 1)"),
    ("train.eps_low", -0.1, "config.train.eps_low = -0.1: must be in [0, 1)"),
    ("train.eps_high", 0.0, "config.train.eps_high = 0.0: must be > 0"),
    ("train.critic_updates_per_step", 0,
     "config.train.critic_updates_per_step = 0: must be >= 1 (K critic"),
    ("train.batch_size", 12,
     "must be divisible by the number of devices (8); fix: use a multiple of 8"),
    ("train.gamma", 1.5, "config.train.gamma = 1.5: must be in [0, 1]"),
    ("train.lam_policy", "adaptiv", "config.train.lam_policy = 'adaptiv': must be 'adaptive'"),
    ("rollout.temperature", 0.0, "config.rollout.temperature = 0.0: must be > 0"),
    ("model.n_kv_heads", 3, "config.model.n_kv_heads = 3: must be >= 1 and divide model.n_heads"),
    ("task.name", "chess", "config.task.name = 'chess': must be one of"),
    ("rollout.max_prefill_length", 4096, "must be <= model.max_seq_len"),
    ("task.obs_pad", 100, "config.task.obs_pad = 100: each padded observation"),
    ("train.policy_lr", float("nan"), "config.train.policy_lr = nan: must be finite"),
    ("task.tool_latency_median_s", -0.2,
     "config.task.tool_latency_median_s = -0.2: must be >= 0 (median s"),
    ("task.tool_latency_sigma", -1.0, "config.task.tool_latency_sigma = -1.0: must be >= 0"),
    ("task.tool_latency_median_s", 2.0,  # 2 e^4 = 109 s > env_timeout_s = 30
     "config.task.tool_latency_median_s = 2.0: its tail (median * e^(4 sigma)"),
    ("rollout.env_workers", -2, "config.rollout.env_workers = -2: must be >= -1"),
])
def test_impossible_values_name_the_field_and_the_fix(field, value, needle):
  c = _config()
  group, key = field.split(".")
  c[group][key] = value
  with pytest.raises(ConfigError) as ei:
    validate_config(c, num_devices=8)
  assert needle in str(ei.value)
  assert "fix:" in str(ei.value)


def test_tool_latency_only_for_the_arith_task_and_a_sane_setting_passes():
  c = _config()
  c.task.tool_latency_median_s, c.task.tool_latency_sigma = 0.2, 1.0
  validate_config(c, num_devices=1)  # 0.2 e^4 = 10.9 s < 30 s
  c.task.name = "math"
  with pytest.raises(ConfigError, match="only implemented for task.name='arith_tool'"):
    validate_config(c, num_devices=1)


def test_unknown_keys_and_wrong_types_are_all_listed_in_one_error():
  d = _config().to_dict()
  d["train"]["eps_lo"] = 0.2            # typo
  d["model"]["dtype"] = 16             # wrong type
  d["train"]["critic_updates_per_step"] = 0
  with pytest.raises(ConfigError) as ei:
    validate_config(ml_collections.ConfigDict(d), num_devices=1)
  assert len(ei.value.problems) == 3
  msg = str(ei.value)
  assert "config.train.eps_lo: unknown key; fix: remove it or use config.train.eps_low" in msg
  assert "config.model.dtype = 16: wrong type int; fix: give a str" in msg


def test_mesh_larger_than_the_machine():
  c = _config()
  c.mesh.shape = "data=4,fsdp=4"
  with pytest.raises(ConfigError) as ei:
    validate_config(c, num_devices=8)
  assert "config.mesh.shape = 'data=4,fsdp=4': needs 16 devices" in str(ei.value)
  c.mesh.shape = "fsdp=-1"  # every device: fine on 8, batch 32 divides
  validate_config(c, num_devices=8)
  c.mesh.shape = "fsdp=three"
  with pytest.raises(ConfigError, match="entries look like 'fsdp=8'"):
    validate_config(c, num_devices=8)
  c.mesh.shape = "data=-1"
  c.train.batch_size = 12
  with pytest.raises(ConfigError, match="must be divisible by the mesh's data x fsdp size"):
    validate_config(c, num_devices=8)


def _main(*args):
  return subprocess.run([sys.executable, "-m", "sao_jax.main", *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.slow
def test_cli_refuses_every_bad_field_at_once_before_training(tmp_path):
  """The real CLI: several bad enum / range values in one run; all named, nothing trained.
  (Measured here: the refusal takes 1.2-3.2 s on :smoke, before the trainer's imports.)"""
  run_dir = tmp_path / "run"
  bad = {"train.mode": "ppo", "rollout.kv_on_update": "sometimes", "train.aggregation": "avg",
         "train.objective": "ppo_clp", "rollout.staleness_policy": "sometimes",
         "log.progress": "fancy", "model.dtype": "float8", "train.eps_low": "1.0",
         "train.critic_updates_per_step": "0", "train.lam_critic": "2.0",
         "train.value_clip_eps": "-0.1"}
  proc = _main("--config=configs/arith_tool.py:smoke", f"--config.run_dir={run_dir}",
               *(f"--config.{k}={v}" for k, v in bad.items()))
  assert proc.returncode != 0
  err = proc.stderr
  assert "Traceback" not in err, err[-3000:]
  for field in bad:
    assert f"config.{field} = " in err, field
  assert "config.train.eps_low = 1.0: must be in [0, 1)" in err
  assert "config.train.critic_updates_per_step = 0: must be >= 1 (K critic" in err
  assert not (run_dir / "metrics.jsonl").exists()  # nothing was trained
  assert not run_dir.exists()  # nothing was built at all


def test_cli_names_a_misspelt_override_in_one_line():
  """A ``--config.`` override of a field the config does not have: one line naming the field,
  ml_collections' suggestion and the fix; no traceback (``configs.parse_flags``)."""
  proc = _main("--config=configs/arith_tool.py:smoke", "--config.train.bach_size=4")
  assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
  assert ('config.train.bach_size: unknown field (Did you mean "batch_size" instead of '
          '"bach_size"?); fix: use a field listed in docs/config.md') in proc.stderr
  proc = _main("--config=configs/arith_tool.py:smoke", "--config.trian.batch_size=4")
  assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
  assert 'config.trian: unknown field (Did you mean "train"' in proc.stderr


@pytest.mark.parametrize("content,lineno,needle", [
    (b'{"id": "a", "problem": "p", "answer": "1"}\n\n{"id": "b", "problem": "q", "answer": "2"}\n',
     2, "empty line"),
    (b'{"id": "a", "problem": "p", "answer": "1"}\n{"id": "b", "problem": "q"}\n', 2, "'answer'"),
    (b'{"id": "a", "problem": "p\xc3\x28", "answer": "1"}\n', 1, "invalid UTF-8"),
    (b'{"id": "a", "problem": "", "answer": "1"}\n', 1, "field 'problem' is empty"),
])
def test_data_errors_name_file_and_line(tmp_path, content, lineno, needle):
  p = tmp_path / "bad.jsonl"
  p.write_bytes(content)
  with pytest.raises(ValueError) as ei:
    load_math_problems(p, blank_lines="error")
  assert str(ei.value).startswith(f"{p}:{lineno}: ")
  assert needle in str(ei.value)


def test_final_newline_is_not_an_empty_line(tmp_path):
  p = tmp_path / "ok.jsonl"
  p.write_bytes(b'{"id": "a", "problem": "p", "answer": "1"}\n')
  assert [x.id for x in load_math_problems(p, blank_lines="error")] == ["a"]


# ---- run_dir, model.checkpoint_dir, start-of-run warnings ---------------------------------------
def _problems(c) -> list[str]:
  try:
    validate_config(c, num_devices=1)
  except ConfigError as e:
    return e.problems
  return []


def _read_only_folder(path):
  """A folder this user cannot write to: chmod 555 (not root), else a read-only tmpfs (root,
  which ignores permission bits); None when neither is possible (the caller skips)."""
  os.makedirs(path)
  if os.geteuid() != 0:
    os.chmod(path, 0o555)
    return lambda: os.chmod(path, 0o755)
  if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)],
                    capture_output=True, check=False).returncode != 0:
    return None
  return lambda: subprocess.run(["umount", str(path)], check=False)


def test_run_dir_that_is_a_file_below_a_file_empty_or_not_writable_is_named_with_the_fix(tmp_path):
  c = _config("arith_tool", "smoke")
  c.run_dir = str(tmp_path / "new" / "run")  # missing folders are created: fine
  assert _problems(c) == []
  (tmp_path / "afile").write_text("x")
  for run_dir, what in ((tmp_path / "afile", "is an existing file, not a folder"),
                        (tmp_path / "afile" / "run", f"is below the file {tmp_path / 'afile'}"),
                        ("", "empty")):
    c.run_dir = str(run_dir)
    assert _problems(c) == [f"config.run_dir = {str(run_dir)!r}: {what}; fix: give a folder "
                            "path, e.g. --config.run_dir=runs/my_run (created if missing)"]
  undo = _read_only_folder(tmp_path / "ro")
  if undo is None:
    pytest.skip("no way to make a read-only folder here (root without mount)")
  try:
    for run_dir, what in ((tmp_path / "ro", "this folder"),
                          (tmp_path / "ro" / "run", f"its parent {tmp_path / 'ro'}")):
      c.run_dir = str(run_dir)
      (p,) = _problems(c)
      assert p.startswith(f"config.run_dir = {str(run_dir)!r}: {what} is not writable by this "
                          "user") and "fix: use a folder you can write to" in p
  finally:
    undo()


def test_checkpoint_dir_one_level_off_points_at_the_checkpoints_folder(tmp_path):
  """A run folder (what ``run_dir`` names) instead of its ``checkpoints/`` subfolder, a missing
  path, a file, a folder without any checkpoint: each named with the fix; the checkpoints
  folder itself and a Hugging Face folder pass."""
  c = _config("arith_tool", "smoke")
  run = tmp_path / "run"
  (run / "checkpoints" / "4").mkdir(parents=True)
  (run / "config.json").write_text('{"train": {}, "rollout": {}, "run_dir": "x"}')
  c.model.checkpoint_dir = str(run)
  assert _problems(c) == [f"config.model.checkpoint_dir = {str(run)!r}: is a run folder; its "
                          f"checkpoints are in {run / 'checkpoints'}; fix: "
                          f"--config.model.checkpoint_dir={run / 'checkpoints'}"]
  c.model.checkpoint_dir = str(run / "checkpoints")
  assert _problems(c) == []
  (tmp_path / "hf").mkdir()
  (tmp_path / "hf" / "config.json").write_text('{"model_type": "llama"}')
  c.model.checkpoint_dir = str(tmp_path / "hf")
  assert _problems(c) == []
  (tmp_path / "empty").mkdir()
  for d, what in ((tmp_path / "nowhere", "does not exist"), (run / "config.json", "is a file"),
                  (tmp_path / "empty", "holds no complete checkpoint")):
    c.model.checkpoint_dir = str(d)
    (p,) = _problems(c)
    assert p.startswith(f"config.model.checkpoint_dir = {str(d)!r}: {what}") and \
        "fix: give a Hugging Face folder" in p
  (run / "checkpoints" / "4").rmdir()
  (run / "checkpoints").rmdir()  # a run that saved no checkpoint (still a run folder)
  c.model.checkpoint_dir = str(run)
  (p,) = _problems(c)
  assert "is a run folder without checkpoints" in p


def test_load_policy_params_from_a_run_folder_names_its_checkpoints_folder(tmp_path):
  from sao_jax.train.checkpoint import load_policy_params  # pylint: disable=import-outside-toplevel
  (tmp_path / "checkpoints").mkdir()
  with pytest.raises(FileNotFoundError, match="it is a run folder: its checkpoints are in "
                     f"'{tmp_path / 'checkpoints'}', so use --config.model.checkpoint_dir="):
    load_policy_params(str(tmp_path), {})


def test_ppo_family_with_one_minibatch_warns_once_at_the_start(tmp_path, monkeypatch, capsys):
  c = _config("arith_tool", "smoke")
  assert validation.config_warnings(c) == []  # SAO's DIS
  for overrides in ({"mode": "grpo_async"}, {"objective": "tis"}, {"mode": "vapo"}):
    c = _config("arith_tool", "smoke")
    c.train.update(overrides)
    (line,) = validation.config_warnings(c)
    assert line.startswith("warning: train.objective resolves to ") and \
        "train.policy_minibatches=1" in line and "the clip never acts" in line
    c.train.policy_minibatches = 4
    assert validation.config_warnings(c) == []
  # the driver prints it once, before anything is built
  from sao_jax.train import loop  # pylint: disable=import-outside-toplevel

  class Stop(Exception):
    pass

  def stop(_):
    raise Stop
  monkeypatch.setattr(loop.tasks, "make_task", stop)
  c = _config("arith_tool", "smoke")
  c.train.objective, c.run_dir = "ppo_clip", str(tmp_path / "run")
  with pytest.raises(Stop):
    loop.run(c)
  err = capsys.readouterr().err
  assert [l for l in err.splitlines() if l.startswith("warning:")] == \
      validation.config_warnings(c)


@pytest.mark.slow
def test_cli_bad_run_dir_and_checkpoint_dir_exit_with_the_fields_and_no_traceback(tmp_path):
  (tmp_path / "afile").write_text("x")
  (tmp_path / "run" / "checkpoints").mkdir(parents=True)
  proc = _main("--config=configs/arith_tool.py:smoke", f"--config.run_dir={tmp_path / 'afile'}",
               f"--config.model.checkpoint_dir={tmp_path / 'run'}")
  assert proc.returncode == 1, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
  assert f"config.run_dir = {str(tmp_path / 'afile')!r}: is an existing file" in proc.stderr
  assert f"fix: --config.model.checkpoint_dir={tmp_path / 'run' / 'checkpoints'}" in proc.stderr

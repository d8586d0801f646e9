"""Config and data validation: every bad field named with its fix, before anything is built."""

import importlib.util
import os
import subprocess
import sys

import ml_collections
import pytest

from sao_jax.config_validation import ConfigError, validate_config
from sao_jax.data.jsonl import load_math_problems

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(name="arith_tool", variant=""):
  spec = importlib.util.spec_from_file_location(f"cfg_{name}", os.path.join(ROOT, "configs",
                                                                            f"{name}.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config(variant)


@pytest.mark.parametrize("name,variant", [("arith_tool", ""), ("arith_tool", "smoke"),
                                          ("aime", "smoke")])
def test_shipped_configs_are_valid(name, variant):
  validate_config(_config(name, variant), num_devices=1)


@pytest.mark.parametrize("field,value,needle", [
    ("train.eps_low", 1.0, "config.train.eps_low = 1.0: must be in [0, 1)"),
    ("train.eps_low", -0.1, "config.train.eps_low = -0.1: must be in [0, 1)"),
    ("train.eps_high", 0.0, "config.train.eps_high = 0.0: must be > 0"),
    ("train.critic_updates_per_step", 0, "config.train.critic_updates_per_step = 0: K must be >= 1"),
    ("train.batch_size", 12, "must be divisible by the number of devices (8); fix: use a multiple of 8"),
    ("train.gamma", 1.5, "config.train.gamma = 1.5: must be in [0, 1]"),
    ("train.lam_policy", "adaptiv", "config.train.lam_policy = 'adaptiv': must be 'adaptive'"),
    ("rollout.temperature", 0.0, "config.rollout.temperature = 0.0: must be > 0"),
    ("model.n_kv_heads", 3, "config.model.n_kv_heads = 3: must be >= 1 and divide model.n_heads"),
    ("task.name", "chess", "config.task.name = 'chess': must be one of"),
    ("rollout.max_prefill_length", 4096, "must be <= model.max_seq_len"),
    ("train.policy_lr", float("nan"), "config.train.policy_lr = nan: must be finite"),
    ("task.tool_latency_median_s", -0.2,
     "config.task.tool_latency_median_s = -0.2: must be >= 0 seconds"),
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


def test_cli_stops_before_building_anything(tmp_path):
  run_dir = tmp_path / "run"
  proc = _main("--config=configs/arith_tool.py:smoke", f"--config.run_dir={run_dir}",
               "--config.train.eps_low=1.0", "--config.train.critic_updates_per_step=0")
  assert proc.returncode != 0
  err = proc.stderr
  assert "config.train.eps_low = 1.0" in err and "config.train.critic_updates_per_step = 0" in err
  assert not run_dir.exists()  # nothing was built, nothing compiled
  proc = _main("--config=configs/arith_tool.py:smoke", "--config.train.bogus=1")
  assert proc.returncode != 0 and "bogus" in proc.stderr  # ml_collections' locked config


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

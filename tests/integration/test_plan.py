"""``python -m sao_jax.plan``: ahead-of-time compilation for a TPU slice on a CPU host (issue 31).

* The real thing (skipped, with the reason, where ``libtpu`` is not installed): the tiny
  ``configs/arith_tool.py:smoke`` model's learner steps and engine programs compiled by XLA's TPU
  compiler for a 4-chip v5e slice (``v5e:2x2``, mesh ``fsdp=4``), through the command line, with
  a 1 KiB fake HBM so that nothing fits: exit status 1, every field to change named, and the
  numbers checked against what the shapes imply -- the policy update's per-chip arguments are
  its float32 params and two Adam moments over 4 chips plus the batch; the learner's FLOPs are
  within 25% of 6 N tokens (updates) and 2 N tokens (targets) per chip.
* Without ``libtpu``: the message that says how to install it, exit status 2.
* The pieces, in-process and without compiling: accelerator types -> topologies and chip counts,
  the linear fit in depth, XLA's refusal message, the advice, an abstract ``Learner`` (shapes
  with shardings, nothing on a device) and the model FLOPs counted from the traced steps.
"""

from __future__ import annotations

import repo_paths  # tests/repo_paths.py
import dataclasses
import json
import math
import os
import subprocess
import sys
import unittest.mock

import jax
import pytest
from jax.sharding import NamedSharding

from sao_jax import configs, plan
from sao_jax.train import sharding

ROOT = repo_paths.ROOT
GIB = 1 << 30


def _env() -> dict:
  env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=ROOT)
  env.pop("XLA_FLAGS", None)  # the suite's CPU optimisation level is not what users compile with
  return env


@pytest.mark.skipif(not plan.libtpu_available(),
                    reason='libtpu is not installed (pip install -e ".[tpu]"): no TPU compiler')
@pytest.mark.slow
def test_plan_compiles_for_a_tpu_slice_and_names_the_fields_when_nothing_fits(tmp_path):
  out = tmp_path / "plan.json"
  proc = subprocess.run(
      [sys.executable, "-m", "sao_jax.plan", "--config=configs/arith_tool.py:smoke",
       "--config.mesh.shape=fsdp=-1", "--topology=v5e:2x2", "--hbm_gib=0.000001",
       f"--json={out}"], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
  assert proc.returncode == 1, proc.stdout + proc.stderr
  for field in ("mesh.shape", "mesh.tokens_per_device", "rollout.slots",
                "rollout.max_prefill_length", "DOES NOT FIT"):
    assert field in proc.stdout, (field, proc.stdout)
  report = json.loads(out.read_text())
  assert report["chips"] == 4 and report["mesh"] == {"fsdp": 4} and report["depths"] is None
  progs = {p["key"]: p for p in report["programs"]}
  assert set(progs) == {"targets", "critic", "policy", "prefill", "decode"}
  assert list(report["compiled"]) == ["2"]  # compiled at the model's depth, nothing fitted
  for p in progs.values():
    assert not p["refused"] and not p["fits"]
    assert p["argument"] > 0 and p["total"] >= p["argument"] and p["compile_s"] > 0
  # K = 2: the first critic update runs inside the targets program (one critic forward for
  # both, Learner.jitted_steps' first_critic), the second as the critic program
  assert progs["critic"]["calls"] == 1 and progs["policy"]["calls"] == 1
  # donated train states come back in place
  for k in ("critic", "policy"):
    assert progs[k]["alias"] > 0.9 * progs[k]["argument"] - _batch_bytes(report) / 4
  n, tokens, chips = report["model"]["params"], report["tokens_per_step"], report["chips"]
  # policy update arguments: float32 params + Adam mu, nu, sharded 4 ways, plus the batch
  states = 3 * 4 * n / chips
  assert 0.9 * states < progs["policy"]["argument"] < 1.3 * states + _batch_bytes(report)
  # engine: float32 params on one chip plus the KV cache of 8 slots x 65 positions x 2 layers
  cache = 2 * 2 * 8 * 2 * 32 * 65 * 4
  assert 0.95 * (4 * n + cache) < progs["decode"]["argument"] < 1.5 * (4 * n + cache)
  six_nt = 6 * n * tokens / chips
  assert 0.75 * six_nt < progs["policy"]["flops"] < 1.25 * six_nt
  assert 0.75 * six_nt < progs["critic"]["flops"] < 1.25 * six_nt
  # targets + the first critic update from one forward: one critic update's FLOPs
  assert 0.75 * six_nt < progs["targets"]["flops"] < 1.25 * six_nt
  step = progs["targets"]["flops"] + progs["critic"]["flops"] + progs["policy"]["flops"]
  assert report["step_flops"] == pytest.approx(step)
  assert report["step_time_s"] == pytest.approx(step / (197e12 * 0.4))


ENGINE_LAYOUTS = r'''
import json, sys
from sao_jax import configs, plan
from sao_jax.rollout import placement
config = configs.load("arith_tool", "smoke")
mcfg = plan.model_config(config)
devices = plan.slice_devices(plan.parse_slice("v5e:2x2"))
out = {}
for text, n in (("data=1", 1), ("data=2", 2), ("tensor=2", 2)):
  mesh = placement.rollout_mesh(text, devices[:n])
  (p,) = plan.engine_programs(config, mcfg, mesh, ["decode"], log=lambda m: None)
  out[text] = p.argument
print("ARGS " + json.dumps(out))
'''


@pytest.mark.skipif(not plan.libtpu_available(),
                    reason='libtpu is not installed (pip install -e ".[tpu]"): no TPU compiler')
@pytest.mark.slow
def test_the_engine_on_a_tensor_2_sub_mesh_holds_half_the_weights_per_chip():
  """The engine's decode step compiled by XLA's TPU compiler on 1 chip, on 2 chips as data=2
  (slots split, weights replicated) and on 2 chips as tensor=2 (weights and KV heads split).
  Per chip, argument bytes = weights W + decode state S: 1 chip W + S, data=2 W + S/2, tensor=2
  W_t + S/2 (the KV cache split by heads instead of slots). So S/2 = a(1) - a(data=2), W =
  a(data=2) - S/2 and W_t = a(tensor=2) - S/2: about W / 2 (norms stay replicated)."""
  proc = subprocess.run([sys.executable, "-c", ENGINE_LAYOUTS], cwd=ROOT, env=_env(),
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  a = json.loads(proc.stdout.split("ARGS ", 1)[1])
  half_state = a["data=1"] - a["data=2"]
  weights, weights_t = a["data=2"] - half_state, a["tensor=2"] - half_state
  assert half_state > 0
  config = configs.load("arith_tool", "smoke")
  from sao_jax.models.transformer import Transformer  # pylint: disable=import-outside-toplevel
  n = plan.count_params(plan.abstract_params(Transformer, plan.model_config(config))[1])
  assert weights == pytest.approx(4 * n, rel=0.05)  # float32 params, whole on each chip
  assert 0.45 < weights_t / weights < 0.6, a


def _batch_bytes(report) -> float:
  """Bytes of the whole ``Batch`` (6 [B, T] arrays of 1-4 bytes, 6 [B] arrays), upper bound."""
  return 4 * report["rows"] * (report["length"] * 6 + 6)


@pytest.mark.slow
def test_a_missing_libtpu_says_how_to_install_it():
  code = ("import sys, runpy; sys.modules['libtpu'] = None; sys.argv = ['plan', "
          "'--config=configs/arith_tool.py:smoke', '--topology=v5litepod-8']; "
          "runpy.run_module('sao_jax.plan', run_name='__main__')")
  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 2, proc.stdout + proc.stderr
  assert 'pip install -e ".[tpu]"' in proc.stderr and "libtpu" in proc.stderr


@pytest.mark.parametrize("name, topology, chips, chip", [
    ("v5litepod-8", "v5e:2x4", 8, "v5e"), ("v5litepod-16", "v5e:4x4", 16, "v5e"),
    ("v5e-4", "v5e:2x2", 4, "v5e"), ("v5p-8", "v5p:2x2x1", 4, "v5p"),
    ("v5p-64", "v5p:2x4x4", 32, "v5p"), ("v6e-8", "v6e:2x4", 8, "v6e"),
    ("v6e-1", "v6e:1x1", 1, "v6e"), ("v5e:2x2", "v5e:2x2", 4, "v5e"),
    ("V5P:2x2x2", "v5p:2x2x2", 8, "v5p")])
def test_accelerator_types_map_to_topologies_and_chips(name, topology, chips, chip):
  sl = plan.parse_slice(name)
  assert (sl.topology, sl.chips, sl.chip.name) == (topology, chips, chip)
  assert sl.chip.hbm_bytes == {"v5e": 16, "v5p": 95, "v6e": 32}[chip] * GIB


@pytest.mark.parametrize("name", ["v4-8", "v5p-7", "v5litepod-6", "v5e:2x2x1", "tpu"])
def test_unknown_slices_name_the_flag(name):
  with pytest.raises(ValueError, match="--topology"):
    plan.parse_slice(name)


def test_depth_fit_is_linear_and_exact_for_linear_quantities():
  def prog(depth, refused=False):
    return plan.Program("p", argument=10 + 3 * depth, output=1.0, alias=0.5, temp=7 * depth,
                        resident=2 + depth, flops=100 + 40 * depth, refused=refused)
  got = plan.extrapolate({1: [prog(1)], 2: [prog(2, refused=True)]}, 28)[0]
  want = prog(28)
  for f in ("argument", "output", "alias", "temp", "resident", "flops"):
    assert getattr(got, f) == pytest.approx(getattr(want, f)), f
  assert got.refused
  assert plan.parse_depths("auto", 28) == (1, 2) and plan.parse_depths("auto", 2) is None
  assert plan.parse_depths("full", 28) is None and plan.parse_depths("2,4", 28) == (2, 4)
  with pytest.raises(ValueError, match="--depths"):
    plan.parse_depths("3,2", 28)


def test_refusal_message_gives_the_temporaries():
  msg = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
         "temporaries (26.42G) exceeds available HBM (15.75G).")
  assert plan.refused_temp_bytes(msg) == pytest.approx(26.42 * GIB)
  assert plan.refused_temp_bytes("(512M)  HLO temporaries (512M)") == 512 << 20
  assert math.isnan(plan.refused_temp_bytes("some other error"))


def test_advice_names_the_fields_of_what_does_not_fit():
  config = configs.load("aime")
  hbm = 16 * GIB
  rows = [dict(name="policy update (8 micro-batches)", learner=True, fits=False, refused=True,
               total=40 * GIB, argument=1 * GIB, resident=1 * GIB),
          dict(name="critic update", learner=True, fits=True, refused=False, total=8 * GIB,
               argument=GIB, resident=GIB),
          dict(name="engine decode step", learner=False, fits=False, refused=False,
               total=20 * GIB, argument=19 * GIB, resident=0.0)]
  out = plan.advice(config, dict(programs=rows, hbm_bytes=hbm, tokens_per_device=8192))
  assert len(out) == 2
  assert "policy update" in out[0] and "refused" in out[0] and "40 GiB" in out[0]
  assert "mesh.shape (now 'fsdp=-1')" in out[0] and "mesh.tokens_per_device (now 8192)" in out[0]
  assert "rollout.slots (now 32)" in out[1] and "model.max_seq_len (now 4096)" in out[1]
  states = plan.advice(config, dict(programs=[dict(rows[0], argument=10 * GIB,
                                                   resident=10 * GIB)],
                                    hbm_bytes=hbm, tokens_per_device=8192))
  assert "only more chips help" in states[0]


@pytest.mark.slow
def test_an_abstract_learner_holds_shapes_with_shardings_and_counts_model_flops():
  config = configs.load("arith_tool", "smoke")
  mcfg = plan.model_config(config)
  mesh = sharding.make_mesh({"data": 1}, devices=jax.devices()[:1])
  st = plan._abstract_steps(config, mcfg, mesh)  # pylint: disable=protected-access
  for tree in (st.learner.policy, st.learner.critic):
    leaves = jax.tree.leaves(tree)
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    assert all(isinstance(x.sharding, NamedSharding) for x in leaves)
  assert jax.tree.map(lambda x: (x.shape, x.dtype), st.learner.policy.params) == \
      jax.tree.map(lambda x: (x.shape, x.dtype), plan.abstract_params(
          __import__("sao_jax.models.transformer", fromlist=["Transformer"]).Transformer,
          mcfg)[1])
  flops = plan.learner_flops(config, mcfg)
  n = plan.count_params(st.learner.policy.params)
  tokens = st.rows * st.length
  assert 0.75 < flops["policy"] / (6 * n * tokens) < 1.25
  assert 0.75 < flops["critic"] / (6 * n * tokens) < 1.25
  # with a critic: the targets and the first critic update from one forward (first_critic)
  assert 0.75 < flops["targets"] / (6 * n * tokens) < 1.25
  # deeper models cost more per layer, exactly linearly
  deeper = plan.learner_flops(config, dataclasses.replace(mcfg, n_layers=3))
  one = plan.learner_flops(config, dataclasses.replace(mcfg, n_layers=1))
  for k in flops:
    assert deeper[k] - flops[k] == pytest.approx(flops[k] - one[k], rel=1e-6)
  # remat recomputes the forward: not model FLOPs
  assert plan.learner_flops(config, dataclasses.replace(mcfg, remat="block")) == flops


@pytest.mark.parametrize("name, total, non_embedding", [
    ("qwen3-0.6b", 0.6, 0.44), ("qwen3-1.7b", 1.7, 1.4), ("qwen3-8b", 8.2, 6.95),
    ("qwen3-30b-a3b", 30.5, 29.9)])
@pytest.mark.slow
def test_presets_have_the_published_parameter_counts(name, total, non_embedding):
  """The Qwen3 model cards' counts (billions; non-embedding leaves out the embedding and an
  untied LM head), from the presets' abstract shapes."""
  from sao_jax.models import presets  # pylint: disable=import-outside-toplevel
  from sao_jax.models.transformer import Transformer  # pylint: disable=import-outside-toplevel
  cfg = presets.get_preset(name)
  n = plan.count_params(plan.abstract_params(Transformer, cfg)[1])
  embedding = cfg.vocab_size * cfg.d_model * (1 if cfg.tie_embeddings else 2)
  assert n / 1e9 == pytest.approx(total, rel=0.03)
  assert (n - embedding) / 1e9 == pytest.approx(non_embedding, rel=0.01)


FAKE_WORKER = r'''
import json, os, signal, sys
items = sys.argv[-1].split("=", 1)[1].split(",")
print("SAO_PLAN info " + json.dumps({"rows": 8}), flush=True)
for item in items:
  key, depth = item.split("@")
  print("SAO_PLAN start " + item, flush=True)
  if item in os.environ["CRASH_ON"].split(","):
    os.kill(os.getpid(), signal.SIGSEGV)
  print("SAO_PLAN done " + json.dumps(dict(
      name=key, argument=1.0, output=2.0, alias=0.0, temp=3.0, resident=0.0, flops=4.0,
      key=key, depth=int(depth), learner=key in ("targets", "critic", "policy"))), flush=True)
'''


@pytest.mark.slow
def test_a_compiler_crash_loses_one_program_and_the_rest_goes_on(tmp_path, monkeypatch):
  worker = tmp_path / "worker.py"
  worker.write_text(FAKE_WORKER)
  monkeypatch.setenv("CRASH_ON", "critic@1,decode@2")
  run = plan.measure_isolated(["--flag"], command=[sys.executable, str(worker)])
  items = [(k, d) for d in (1, 2) for k in plan.LEARNER_PROGRAMS + plan.ENGINE_PROGRAMS]
  logs = []
  results, info = run(None, None, None, items, logs.append)
  assert info == {"rows": 8} and set(results) == set(items)
  crashed = {item for item, p in results.items() if p.crashed}
  assert crashed == {("critic", 1), ("decode", 2)}
  assert math.isnan(results["critic", 1].total) and results["critic", 1].learner
  assert results["decode", 2].name == "engine decode step (compiler crashed)"
  assert results["policy", 2].temp == 3.0 and not results["policy", 2].crashed
  assert sum("crashed (signal 11)" in m for m in logs) == 2
  worker.write_text(FAKE_WORKER.replace("SIGSEGV", "SIGTERM"))  # stopped, not a crash
  with pytest.raises(RuntimeError, match="exit status -15"):
    run(None, None, None, items, logs.append)
  monkeypatch.setenv("CRASH_ON", "")
  worker.write_text("import sys; sys.exit(3)")
  with pytest.raises(RuntimeError, match="exit status 3"):
    run(None, None, None, items, logs.append)


def test_chip_bytes_counts_one_chips_shard_and_key_arrays():
  mesh = sharding.make_mesh({"data": 1}, devices=jax.devices()[:1])
  rep = NamedSharding(mesh, jax.sharding.PartitionSpec())
  tree = {"w": jax.ShapeDtypeStruct((4, 6), "bfloat16", sharding=rep),
          "key": jax.eval_shape(lambda: jax.random.key(0)), "none": None}
  assert plan.chip_bytes(tree) == 4 * 6 * 2 + 8


@pytest.mark.parametrize("model", ["qwen3-0.6b", "", "hf"])
def test_the_planned_model_runs_as_the_config_says(model, tmp_path):
  """``model.remat`` and ``model.scan_layers`` reach the planned ``ModelConfig`` for a preset, a
  Hugging Face folder (``model.checkpoint_dir``; only its ``config.json`` is read) and the
  config's own model (they decide the training forward's memory, so a plan without them
  measures another program); lengths and dtypes come from the config too."""
  from sao_jax.models import hf, presets  # pylint: disable=import-outside-toplevel
  c = configs.load("aime", "smoke")
  c.model.remat, c.model.scan_layers, c.model.max_seq_len = "block", True, 1024
  if model == "hf":
    with open(tmp_path / "config.json", "w", encoding="utf-8") as f:
      json.dump(hf.config_to_hf(presets.get_preset("smollm2-135m")), f)
    c.model.checkpoint_dir, model = str(tmp_path), ""
  mcfg = plan.model_config(c, model=model)
  assert (mcfg.remat, mcfg.scan_layers, mcfg.max_seq_len) == ("block", True, 1024)
  assert mcfg.dtype == c.model.dtype
  if c.model.checkpoint_dir:
    assert (mcfg.n_layers, mcfg.d_model, mcfg.vocab_size) == (30, 576, 49152)


def test_routed_moe_flops_count_the_routed_experts_only():
  """XLA:CPU counts ``ragged_dot`` densely over every expert; the plan counts what routing
  computes: the same FLOPs whatever the expert count at fixed top-k, and below the dense count
  over all experts by about n_experts / n_experts_per_tok in the MLP."""
  config = configs.load("arith_tool", "smoke")
  base = plan.model_config(config)
  moe = lambda e: dataclasses.replace(base, arch="qwen3_moe", n_experts=e, n_experts_per_tok=2,
                                      moe_d_ff=16, moe_layers=tuple(range(base.n_layers)))
  four, sixteen = plan.learner_flops(config, moe(4)), plan.learner_flops(config, moe(16))
  assert four == sixteen
  assert plan.routed_flops_equivalent(moe(16)).d_ff == 2 * 16
  assert plan.routed_flops_equivalent(base) is base
  # the uncorrected count grows with the expert count
  traced = {}
  for e in (4, 16):
    with unittest.mock.patch.object(plan, "routed_flops_equivalent", lambda m: m):
      traced[e] = plan.learner_flops(config, moe(e))
  for k in four:
    assert traced[16][k] > traced[4][k] > four[k]

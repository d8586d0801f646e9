"""Fault handling: env exceptions/timeouts/NaN rewards become failed trajectories, NaN/inf updates
are skipped (params and Adam state unchanged) and the run stops after N in a row, a full disk on
checkpoint raises a clear error and leaves the previous checkpoint intact, the prompt ledger
refuses double counting."""

import json
import os
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sao_jax.data.jsonl import Problem
from sao_jax.envs.base import EnvStep
from sao_jax.envs.guard import EnvTimeout, GuardedEnv
from sao_jax.train import optim
from sao_jax.train.checkpoint import Checkpointer, CheckpointError
from sao_jax.rollout.ledger import PromptLedger
from sao_jax.train.resume import NonFiniteError, NonFiniteGuard, truncate_jsonl

P = Problem("p1", "Compute 1+1.", "2")


class _Env:
  max_turns = 1

  def __init__(self, behaviour):
    self.behaviour = behaviour

  def prompt_ids(self, problem):
    return [1]

  def step(self, problem, turn, action_ids):
    if self.behaviour == "raise":
      raise KeyError("reward table missing")
    if self.behaviour == "hang":
      time.sleep(2.0)
    reward = {"nan": float("nan"), "str": "1.0", "none": None, "vec": np.ones(2),
              "np": np.float32(0.5)}.get(self.behaviour, 1.0)
    return EnvStep([], True, reward, {})


def test_guarded_env_passes_good_steps_and_raises_for_each_fault():
  assert GuardedEnv(_Env("ok"), timeout_s=5).step(P, 0, [2]).reward == 1.0
  with pytest.raises(KeyError, match="reward table"):
    GuardedEnv(_Env("raise"), timeout_s=5).step(P, 0, [2])
  with pytest.raises(EnvTimeout, match="rollout.env_timeout_s=0.2s"):
    GuardedEnv(_Env("hang"), timeout_s=0.2).step(P, 0, [2])
  with pytest.raises(ValueError, match="EnvStep.reward for problem p1 is nan, not finite"):
    GuardedEnv(_Env("nan"), timeout_s=5).step(P, 0, [2])


def test_guarded_env_refuses_a_reward_that_is_not_one_real_number_naming_the_field():
  """A string (even "1.0"), None or an array is refused naming ``EnvStep.reward`` (the worker
  then records a failed trajectory with reward 0 and this reason, as for any env error); a NumPy
  scalar passes as a plain float."""
  got = GuardedEnv(_Env("np"), timeout_s=None).step(P, 0, [2]).reward
  assert got == 0.5 and type(got) is float  # pylint: disable=unidiomatic-typecheck
  for behaviour, what in (("str", r"is str '1.0', not a real number"),
                          ("none", "is NoneType None, not a real number"),
                          ("vec", r"has shape \(2,\), not one scalar per episode")):
    with pytest.raises(ValueError, match=f"EnvStep.reward for problem p1 {what}; env.step must "
                                         "return one finite float"):
      GuardedEnv(_Env(behaviour), timeout_s=5).step(P, 0, [2])


@pytest.mark.slow
def test_worker_records_env_faults_as_failed_trajectories_and_counts_them():
  from sao_jax.data.tokenizer import CharTokenizer
  from sao_jax.envs.arith_tool import ArithToolEnv, make_problems
  from sao_jax.models.transformer import ModelConfig, Transformer
  from sao_jax.rollout.engine import SAOEngine
  from sao_jax.rollout.worker import generate_trajectories
  from flax import nnx
  tok = CharTokenizer()
  cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1,
                    head_dim=16, d_ff=64, max_seq_len=48)
  graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
  params = nnx.to_pure_dict(params)
  engine = SAOEngine(cfg, graphdef, tok, max_concurrent_decodes=4, max_prefill_length=32)
  env = GuardedEnv(ArithToolEnv(tok, max_turns=1), timeout_s=2.0, fault_rate=1.0)
  trajs = generate_trajectories(engine, env, params, make_problems(6, 0), stop_ids=tok.stop_ids,
                                max_new_tokens=4, max_seq_len=48, temperature=1.0)
  assert len(trajs) == 6 and all(t.info["failed"] and t.reward == 0.0 for t in trajs)
  reasons = sorted(t.info["error"].split(":")[0] for t in trajs)
  assert reasons == ["EnvTimeout"] * 2 + ["InjectedFault"] * 2 + ["ValueError"] * 2


def test_nonfinite_gradients_leave_params_and_adam_state_unchanged():
  params = {"w": jnp.ones((3,)), "b": jnp.zeros((2,))}
  tx = optim.make_optimizer(params, lr=0.1)
  state = tx.init(params)
  grads = {"w": jnp.array([1.0, jnp.nan, 0.0]), "b": jnp.ones((2,))}
  updates, new_state = tx.update(grads, state, params)
  for leaf in jax.tree.leaves(updates):
    np.testing.assert_array_equal(np.asarray(leaf), 0.0)
  inner_old, inner_new = state.inner_state, new_state.inner_state
  for a, b in zip(jax.tree.leaves(inner_old), jax.tree.leaves(inner_new)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert int(new_state.notfinite_count) == 1 and int(new_state.total_notfinite) == 1
  good = {"w": jnp.ones((3,)), "b": jnp.ones((2,))}
  updates, _ = tx.update(good, new_state, params)
  assert float(jnp.abs(updates["w"]).sum()) > 0  # finite gradients apply again


def test_nonfinite_guard_skips_then_stops_after_n_in_a_row():
  g = NonFiniteGuard(max_consecutive=3)
  assert g.check(1, {"policy_loss": 0.5, "value_loss": 0.1}) is False
  assert g.check(2, {"policy_loss": float("nan")}) is True
  assert g.check(3, {"policy_loss": 0.4}) is False          # the streak resets
  assert g.check(4, {"policy_grad_norm": float("inf")}) is True
  assert g.check(5, {"value_loss": float("nan")}) is True
  with pytest.raises(NonFiniteError, match="3 policy steps in a row.*max_consecutive_nonfinite=3"):
    g.check(6, {"critic_grad_norm": float("nan")})
  assert g.total == 4


@pytest.mark.slow
def test_full_disk_on_checkpoint_is_a_clear_error_and_the_previous_one_survives(tmp_path):
  mnt = tmp_path / "small"
  mnt.mkdir()
  if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)],
                    capture_output=True, check=False).returncode != 0:
    pytest.skip("needs root to mount a small tmpfs")
  try:
    ck = Checkpointer(str(mnt / "ckpt"))
    state = {"w": np.arange(100_000, dtype=np.float32)}  # 400 kB
    ck.save(1, state, meta={"step": 1})
    ck.wait()
    with open(mnt / "filler", "wb") as f:  # fill the disk
      try:
        f.write(b"\0" * (2 * 2**20))
      except OSError:
        pass
    with pytest.raises(CheckpointError, match=r"checkpoint step 2 could not be written to .*"
                       r"MiB free.*The previous checkpoint \(step 1\) is intact"):
      ck.save(2, {"w": state["w"] + 1}, meta={"step": 2})
    os.remove(mnt / "filler")
    restored = ck.restore({"w": np.zeros(100_000, np.float32)})
    np.testing.assert_array_equal(restored["w"], state["w"])
    assert ck.latest_step() == 1 and ck.meta() == {"step": 1}
    ck.close()
  finally:
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_ledger_stream_skips_consumed_and_refuses_double_counting():
  problems = [Problem(f"q{i}", "x", "1") for i in range(5)]
  led = PromptLedger(problems, seed=3)
  first = led.take(4)
  assert [h.position for h in first] == [0, 1, 2, 3]
  assert [h.id for h in first] == [f"q{i}" for i in np.random.default_rng(
      [3, 0]).permutation(5)[:4]]
  led.consume([1, 0])
  with pytest.raises(ValueError, match="consumed twice"):
    led.consume([0])
  with pytest.raises(ValueError, match="never handed out"):
    led.consume([7])
  led.consume([3])
  state = led.state()
  assert state == {"low": 2, "extra": [3], "seed": 3}
  # after a crash: positions 2 (in flight) and 4.. are handed out again, 3 is not
  again = PromptLedger.from_state(problems, state)
  assert [h.position for h in again.take(3)] == [2, 4, 5]
  assert [h.id for h in again.take(0)] == []
  assert PromptLedger.from_state(problems, state).take(1)[0].id == first[2].id


def test_truncate_jsonl_drops_later_steps_and_a_torn_line(tmp_path):
  p = tmp_path / "m.jsonl"
  p.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n{"ste')
  assert truncate_jsonl(str(p), 2) == 2
  assert p.read_text() == '{"step": 1}\n{"step": 2}\n'


def test_resume_refuses_a_run_folder_made_with_another_config(tmp_path):
  from sao_jax.train.resume import check_resume_config  # pylint: disable=import-outside-toplevel
  old = {"run_dir": str(tmp_path), "train": {"num_steps": 100, "mode": "sao", "policy_lr": 3e-4},
         "task": {"tool_latency_median_s": 0.0}, "checkpoint": {"every_steps": 50}}
  (tmp_path / "config.json").write_text(json.dumps(old))
  same_but_longer = json.loads(json.dumps(old))
  same_but_longer["train"]["num_steps"] = 200
  same_but_longer["checkpoint"]["every_steps"] = 10
  check_resume_config(str(tmp_path), json.dumps(same_but_longer), 100, 200)  # allowed
  check_resume_config(str(tmp_path), json.dumps(old), 100, 100)  # re-run: final eval only
  check_resume_config(str(tmp_path), json.dumps({"train": {"mode": "x"}}), None, 5)  # fresh
  other = json.loads(json.dumps(old))
  other["train"]["mode"] = "grpo_sync"
  other["task"]["tool_latency_median_s"] = 0.2
  with pytest.raises(ValueError, match=r"task\.tool_latency_median_s \(was 0\.0, now 0\.2\), "
                                       r"train\.mode \(was 'sao', now 'grpo_sync'\).*"
                                       r"new --config\.run_dir"):
    check_resume_config(str(tmp_path), json.dumps(other), 100, 100)
  with pytest.raises(ValueError, match=r"checkpoint at step 100, past train\.num_steps=5"):
    check_resume_config(str(tmp_path), json.dumps(old), 100, 5)

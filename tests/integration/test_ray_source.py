"""The Ray rollout backend (rollout/ray_source.py) and weight sync (rollout/weight_sync.py).

The Ray tests use ``rollout.weight_sync="transfer"`` (``SAO_TEST_WEIGHT_SYNC=object_store`` runs
the object-store path instead; both pass). They start their own local cluster (2 CPUs, no
dashboard, listening on 127.0.0.1 only), stop it at the end and check that no ``raylet`` /
``gcs_server`` process is left (``_ray_processes``).
"""

import repo_paths  # tests/repo_paths.py
import ast
import dataclasses
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sao_jax import configs, roles
from sao_jax.rollout.ray_local import is_loopback
from sao_jax.rollout.weight_sync import WeightMismatchError, WeightPublisher, WeightPuller

pytestmark = pytest.mark.slow  # every test here is slow (see pyproject's `slow` marker)

ROOT = repo_paths.ROOT
# the actors' weight-pull gate (``weight_sync._gate``): while this file exists, a pull waits
# before each bucket after its first (tests/unit/rollout/test_weight_pull.py holds a pull half-way
# with it)
PULL_GATE = os.path.join(tempfile.gettempdir(), f"sao_pull_gate_{os.getpid()}")


# ---- weight sync, one process (no Ray) ----------------------------------------------------------
def _tree():
  return {"w": jnp.arange(6, dtype=jnp.float32).reshape(2, 3),
          "blocks": {"b": jnp.asarray([1.5, -2.0, 3.25], jnp.bfloat16)}}


def test_transfer_pull_is_exact_newest_wins_and_drain_frees_an_unused_pull():
  pub = WeightPublisher("transfer", ip="127.0.0.1")
  tree = _tree()
  pub.publish(tree, 3)
  ref, unused = pub.ref_for(), pub.ref_for()
  puller = WeightPuller()
  got = puller.pull(ref, expected=tree)
  np.testing.assert_array_equal(np.asarray(got["w"]), np.arange(6).reshape(2, 3))
  assert got["blocks"]["b"].dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(got["blocks"]["b"], np.float32), [1.5, -2.0, 3.25])
  assert puller.pull(ref) is None and puller.version == 3  # an older/equal version is ignored
  pub.drain(unused)  # returns: the armed pull was consumed
  with pytest.raises(ValueError, match="must increase"):
    pub.publish(tree, 3)


def test_mismatched_tree_is_refused_before_any_bytes_move():
  pub = WeightPublisher("transfer", ip="127.0.0.1")
  pub.publish({"w": jnp.zeros((2, 4)), "blocks": {"b": jnp.zeros(3, jnp.bfloat16)}}, 1)
  with pytest.raises(WeightMismatchError, match=r"\['w'\].*float32\[2, 4\].*float32\[2, 3\]"):
    WeightPuller().pull(pub.ref_for(), expected=_tree())
  pub.publish({"w": jnp.zeros((2, 3))}, 2)
  with pytest.raises(WeightMismatchError, match="parameter tree"):
    WeightPuller().pull(pub.ref_for(), expected=_tree())


# ---- the Ray backend ----------------------------------------------------------------------------
def _ray_processes(under: str = "") -> set[int]:
  """PIDs of live raylet / gcs_server processes (read from /proc: no fork in a JAX process);
  with ``under``, only those of a Ray whose temp dir (``RAY_TMPDIR``) is that folder."""
  out = set()
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        cmdline = f.read()
        argv0 = cmdline.split(b"\0")[0]
      if under and under.encode() not in cmdline:
        continue
      with open(f"/proc/{pid}/stat", "rb") as f:
        zombie = f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except OSError:
      continue
    if not zombie and os.path.basename(argv0) in (b"raylet", b"gcs_server"):
      out.add(int(pid))
  return out


def _config():
  c = configs.load("arith_tool", "smoke")
  c.model.d_model, c.model.n_layers, c.model.n_heads, c.model.n_kv_heads = 32, 1, 2, 1
  c.model.head_dim, c.model.d_ff = 16, 64
  c.rollout.slots, c.rollout.max_new_tokens = 4, 8
  # one decode step per engine call: a restarted actor recompiles its engine within the test's
  # deadline on a loaded host (the Ray path used 1 by a fallback before the typed roles)
  c.rollout.decode_steps = 1
  c.rollout.num_workers = 2
  c.rollout.ray_num_cpus = 0.5
  c.rollout.ray_max_outstanding = 4
  c.rollout.weight_sync = os.environ.get("SAO_TEST_WEIGHT_SYNC", "transfer")
  return c


@pytest.fixture(scope="module")
def ray_cluster():
  ray = pytest.importorskip("ray")
  before = _ray_processes()
  env = {"PYTHONPATH": ROOT, "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false",
         "SAO_TEST_PULL_GATE": PULL_GATE}
  from sao_jax.rollout.ray_local import init_ray  # pylint: disable=import-outside-toplevel
  assert init_ray(num_cpus=2, log_to_driver=False, object_store_memory=200 * 1024 ** 2,
                  runtime_env={"env_vars": env}) == "127.0.0.1"
  yield ray
  ray.shutdown()
  deadline = time.time() + 60  # a loaded host can take > 20 s
  while _ray_processes() - before and time.time() < deadline:
    time.sleep(0.5)
  assert not _ray_processes() - before, "a raylet / gcs_server outlived ray.shutdown()"


def _check(traj, versions_at_least: int = 0):
  acts = traj.action_mask > 0
  assert acts.any()
  assert np.all(traj.logprobs[acts] <= 0) and np.all(np.isfinite(traj.logprobs[acts]))
  assert np.all(traj.logprobs[~acts] == 0) and np.all(traj.policy_version[~acts] == -1)
  assert np.all(traj.policy_version[acts] >= versions_at_least)


def test_two_actors_sync_survive_sigkill_and_account_every_prompt_once(ray_cluster):
  from sao_jax import tasks
  from sao_jax.models.transformer import Transformer
  from sao_jax.rollout.ray_source import RaySource
  from sao_jax.pretrained import model_config
  from sao_jax.rollout.ledger import PromptLedger
  config = roles.from_config(_config())
  task = tasks.make_task(config)
  mcfg = model_config(config.model, task.tokenizer.vocab_size)
  params = nnx.to_pure_dict(nnx.split(Transformer(mcfg, rngs=nnx.Rngs(0)))[1])
  ledger = PromptLedger(task.train_problems, seed=0)
  source = RaySource(config, mcfg, ledger, params, version=0)
  try:
    # 2 actors produce valid trajectories at version 0
    first = source.take(8, policy_version=0)
    assert len(first) == 8
    for t in first:
      _check(t)
      assert int(t.policy_version[t.action_mask > 0].max()) == 0
    # version 1 reaches both actors
    shifted = jax.tree.map(lambda x: x + 0.01, params)
    source.publish(shifted, 1)
    deadline, n_sync = time.time() + 30, 0
    while min(a.version for a in source.actors) < 1 and time.time() < deadline:
      n_sync += len(source.take(1, policy_version=1))
    assert [a.version for a in source.actors] == [1, 1]
    # SIGKILL actor 0 while it holds prompts; publish v2 while it is down
    victim = source.actors[0]
    pid = ray_cluster.get(victim.handle.pid.remote())
    deadline = time.time() + 30
    while not victim.outstanding and time.time() < deadline:
      # a full queue hands out no prompts (backpressure): take one to make room, which tops the
      # actors up again (actor 0 first)
      n_sync += len(source.take(1, policy_version=1))
    assert victim.outstanding
    lost, old = set(victim.outstanding), victim.incarnation
    os.kill(pid, signal.SIGKILL)
    source.publish(jax.tree.map(lambda x: x + 0.02, params), 2)
    got = []

    def from_restarted():
      return [t for t in got if t.info["rollout_actor"] == 0
              and t.info["rollout_incarnation"] not in (old, None)]

    deadline = time.time() + 180
    while not (from_restarted() and lost <= source.returned) and time.time() < deadline:
      got += source.take(2, policy_version=2)
    m = source.metrics()
    assert victim.restarts == 1 and m["ray/restarts"] == 1
    assert victim.incarnation != old and victim.version == 2
    assert victim.first_serve_version == 2  # the restarted actor served the latest weights first
    for t in from_restarted():
      _check(t, versions_at_least=2)
    assert lost <= source.returned  # its in-flight prompts came back (issued again)
    assert m["ray/actor1_trajectories"] > 0 and m["ray/actor0_trajectories"] > 0
    for t in got:
      _check(t)
    # exactly once: every ticket handed out is returned once or still outstanding
    assert m["ray/duplicates"] == 0
    assert source.returned | source.outstanding_tickets() == source.handed_out
    assert not source.returned & source.outstanding_tickets()
    taken = len(first) + n_sync + len(got)
    assert len(source.returned) == taken + len(source._arrived)
    assert ledger.low + len(ledger.consumed) == taken  # ledger.consume raises on a double count
  finally:
    source.close()


def test_an_actor_built_from_another_model_config_fails_take_at_once(ray_cluster):
  from sao_jax import tasks
  from sao_jax.models.transformer import Transformer
  from sao_jax.rollout.ray_source import RaySource
  from sao_jax.pretrained import model_config
  from sao_jax.rollout.ledger import PromptLedger
  config = _config()
  config.rollout.num_workers = 1
  config = roles.from_config(config)
  task = tasks.make_task(config)
  mcfg = model_config(config.model, task.tokenizer.vocab_size)
  trainer_cfg = dataclasses.replace(mcfg, d_ff=96)  # the trainer's policy differs
  params = nnx.to_pure_dict(nnx.split(Transformer(trainer_cfg, rngs=nnx.Rngs(0)))[1])
  source = RaySource(config, mcfg, PromptLedger(task.train_problems, seed=0), params)
  try:
    with pytest.raises(WeightMismatchError,
                       match=r"\['mlp'\]\['down_proj'\].*float32\[96, 32\].*float32\[64, 32\]"):
      source.take(1, policy_version=0)  # raised as what it is at the first reply, not retried
  finally:
    source.close()


def test_two_trainer_processes_with_ray_actors_equal_one_process(ray_cluster, tmp_path):
  """Two ``jax.distributed`` trainer processes (gloo), each fed by its own Ray rollout actor,
  run 3 SAO steps; one process on one device, given the same trajectories, gets the same losses
  and params within 1e-5. The learner's steps compile once, an orbax checkpoint saved and
  restored by both processes gives back the params, and the coordinator listens on loopback."""
  import portpicker  # pylint: disable=import-outside-toplevel  (test-only dependency)
  from sao_jax.rollout.trajectory import Trajectory  # pylint: disable=import-outside-toplevel
  from sao_jax.train.learner import Learner, LearnerConfig  # pylint: disable=import-outside-toplevel
  sys.path.insert(0, os.path.join(ROOT, "tests"))
  import multihost_ray_worker as W  # pylint: disable=import-outside-toplevel
  address = ray_cluster.get_runtime_context().gcs_address
  port = portpicker.pick_unused_port()
  from conftest import with_test_xla_flags  # pylint: disable=import-outside-toplevel  (tests/ on the path)
  env = dict(os.environ, XLA_FLAGS=with_test_xla_flags("--xla_force_host_platform_device_count=2"),
             JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
  procs = [subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "multihost_ray_worker.py"),
                             str(i), str(port), address, str(tmp_path)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(2)]
  try:
    logs = [p.communicate(timeout=600)[0] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for p, log in zip(procs, logs):
    assert p.returncode == 0, log[-3000:]
  # a coordinator on localhost binds loopback (distributed.bind_address); gloo's sockets bind
  # the address this machine's hostname resolves to (jax passes gloo no host): loopback when
  # /etc/hosts maps the hostname to 127.x, as on this machine and Debian/Ubuntu defaults
  socks = [ast.literal_eval(re.search(r"listens on (\[.*\])", log).group(1)) for log in logs]
  print("listening:", socks)
  coordinator = [ip for ip, p in socks[0] if p == port]
  assert len(coordinator) == 1 and is_loopback(coordinator[0]), socks
  hostname_ip = socket.gethostbyname(socket.gethostname())
  assert all(is_loopback(ip) or ip.removeprefix("::ffff:") == hostname_ip
             for s in socks for ip, _ in s), socks
  facts = np.load(tmp_path / "facts.npz")
  assert bool(facts["restored_equal"])
  assert facts["compiles"].tolist() == [1, 1, 1, 1]
  got = [np.load(tmp_path / f"trajs{i}.npz") for i in range(2)]
  np.testing.assert_allclose(got[0]["losses"], got[1]["losses"], atol=0)  # replicated metrics
  c = roles.from_config(W.config())
  task, mcfg, graphdef, params, (cg, cp) = W.models(c)
  ref = Learner(LearnerConfig.from_run(c), graphdef, params, cg, cp,
                pad_id=task.tokenizer.pad_id, vocab_size=mcfg.vocab_size)
  losses = []
  for step in range(W.STEPS):
    rows = [Trajectory(problem_id=f"p{i}", reward=float(g[f"s{step}_r{i}_reward"]),
                       **{f: g[f"s{step}_r{i}_{f}"] for f in W.FIELDS})
            for g in got for i in range(W.LOCAL_BATCH)]  # process 0's rows, then process 1's
    assert all(int(r.policy_version.max()) <= step for r in rows)
    m = ref.train_step(rows, step)
    losses.append([m["policy_loss"], m["value_loss"]])
  np.testing.assert_allclose(got[0]["losses"], losses, atol=1e-5, rtol=0)
  final = np.load(tmp_path / "params.npz")
  import sharding_helpers as H  # pylint: disable=import-outside-toplevel
  expected = {**H.flat(ref.policy.params, "policy"), **H.flat(ref.critic.params, "critic")}
  assert set(expected) == set(final.files)
  for k, v in expected.items():
    np.testing.assert_allclose(final[k], v, atol=1e-5, rtol=0, err_msg=k)


# ---- a laptop run opens no port to the network -------------------------------------------------
def _listening(root_pid: int, seen: dict) -> None:
  """Adds to ``seen`` ({pid: [process names, {(ip, port), ...}]}) the TCP sockets listening in
  ``root_pid`` and every process below it (psutil reads /proc; a process that ends meanwhile is
  skipped)."""
  import psutil  # pylint: disable=import-outside-toplevel  (installed with orbax / portpicker)
  try:
    root = psutil.Process(root_pid)
    procs = [root] + root.children(recursive=True)
  except psutil.Error:
    return
  for p in procs:
    try:
      socks = {(c.laddr.ip, c.laddr.port) for c in p.net_connections(kind="inet")
               if c.status == psutil.CONN_LISTEN}
      name = p.name().split(".")[0]  # an actor's title changes with its method: ray::A.poll
    except psutil.Error:
      continue
    if socks:
      names, known = seen.setdefault(p.pid, [set(), set()])
      names.add(name)
      known.update(socks)


def run_watching_sockets(cmd, env, log_path, seen: dict, timeout: float = 600):
  """Runs ``cmd`` (from the repo root, stdout and stderr to ``log_path``: a pipe could fill up
  while we poll), adding to ``seen`` every 0.3 s the TCP sockets that it and its children listen
  on (``_listening``). Returns (return code, output); a run past ``timeout`` s is killed."""
  with open(log_path, "w+") as log:
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + timeout
    while proc.poll() is None and time.time() < deadline:
      _listening(proc.pid, seen)
      time.sleep(0.3)
    if proc.poll() is None:
      proc.kill()
    proc.wait()
    log.seek(0)
    return proc.returncode, log.read()


def assert_loopback_only(seen: dict, ray: bool) -> None:
  """Every socket in ``seen`` (``_listening``) is bound to loopback; with ``ray``, the run's own
  Ray processes were seen listening (GCS, raylet, a rollout actor), so the check is not vacuous."""
  from sao_jax.rollout.ray_local import is_loopback  # pylint: disable=import-outside-toplevel
  listed = {pid: ("/".join(sorted(names)), sorted(socks)) for pid, (names, socks) in seen.items()}
  print("listening during the run (pid: process, sockets):", listed)
  if ray:
    names = " ".join(n for n, _ in listed.values())
    assert "gcs_server" in names and "raylet" in names and "RolloutActor" in names, listed
  exposed = {pid: (n, [s for s in socks if not is_loopback(s[0])])
             for pid, (n, socks) in listed.items()}
  assert not any(e for _, e in exposed.values()), f"listening beyond loopback: {exposed}"


# ---- the actor class itself (no Ray: RolloutActor is a plain class until ray.remote wraps it) --
def _plain_actor():
  from sao_jax import tasks
  from sao_jax.pretrained import model_config
  from sao_jax.rollout.ray_actor import RolloutActor
  config = roles.from_config(_config())
  mcfg = model_config(config.model, tasks.make_task(config).tokenizer.vocab_size)
  return RolloutActor(config, mcfg, 0)


def test_rollout_actor_injects_env_faults_at_the_rate_the_soak_sets(monkeypatch):
  """``SAO_FAULT_ENV_RATE`` reaches the actor's ``GuardedEnv`` as on the thread backend (the Ray
  soak injected no env faults while the actor built its env with the default rate 0)."""
  monkeypatch.setenv("SAO_FAULT_ENV_RATE", "0.25")
  assert _plain_actor().env.fault_rate == 0.25
  monkeypatch.delenv("SAO_FAULT_ENV_RATE")
  assert _plain_actor().env.fault_rate == 0.0


def test_rollout_actor_returns_each_ticket_with_its_hand_out_when_a_problem_is_in_flight_twice():
  """The same problem at two ledger positions (two epochs) in flight at one actor, finishing in
  the reverse order: each trajectory comes back with the ticket of its own hand-out. (Matched
  by problem id, position 9's trajectory came back under position 2's ticket; when the actor
  then died, the driver issued position 9 again and the ledger refused the second consume.)"""
  import types
  from sao_jax.rollout.ledger import Handout
  from sao_jax.rollout.trajectory import Trajectory
  actor = _plain_actor()
  actor.store = types.SimpleNamespace(version=0)
  problem = actor.task.train_problems[0]
  actor.submit(actor.incarnation, [(100, Handout(problem, 2)), (101, Handout(problem, 9))])
  admitted = actor._problems()
  assert [next(admitted).position, next(admitted).position] == [2, 9]
  for position in (9, 2):  # reverse order of admission
    actor._sink(Trajectory(str(problem.id), np.zeros(1, np.int32), np.zeros(1, np.float32),
                           np.zeros(1, np.float32), np.zeros(1, np.int32), 0.0,
                           prompt_position=position))
  got = actor.poll(0)["trajectories"]
  assert [(ticket, t.prompt_position) for ticket, t in got] == [(101, 9), (100, 2)]
  assert actor.submit(actor.incarnation, []) == 0  # nothing left held

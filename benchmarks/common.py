"""Shared harness for the side-by-side benchmarks in ``benchmarks/``.

Every benchmark runs our code and a peer in the same process, *interleaved* (ours, peer, ours,
peer, ...) so that load from other jobs on a shared machine hits both alike; it reports medians
and the ratio of medians. Tables are printed as markdown and optionally written as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Callable, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)


def one_xla_device_per_core() -> None:
  """Adds ``--xla_force_host_platform_device_count=<cores>`` to ``XLA_FLAGS`` unless it names a
  count already, so an engine can split its slots over the host's cores (``SAOEngine(mesh=)``).
  Call before JAX starts (before its first import in the process)."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    count = f"--xla_force_host_platform_device_count={os.cpu_count()}"
    os.environ["XLA_FLAGS"] = f"{flags} {count}".strip()


def block(x):
  """Waits for JAX arrays in ``x`` (any pytree); torch / NumPy results pass through."""
  try:
    import jax  # pylint: disable=import-outside-toplevel
    return jax.block_until_ready(x)
  except (ImportError, TypeError):
    return x


def time_interleaved(fns: dict[str, Callable[[], object]], *, warmup: int = 1,
                     repeats: int = 5) -> dict[str, list[float]]:
  """Calls each ``fns[name]()`` ``warmup`` times (not timed), then ``repeats`` rounds in which
  every function runs once, in turn. Returns seconds per call: ``{name: [t_1..t_repeats]}``.
  Each result is passed through ``block`` so asynchronous JAX dispatch is included."""
  for _ in range(warmup):
    for fn in fns.values():
      block(fn())
  times: dict[str, list[float]] = {k: [] for k in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      t0 = time.perf_counter()
      block(fn())
      times[name].append(time.perf_counter() - t0)
  return times


def median(xs: Sequence[float]) -> float:
  return float(statistics.median(xs))


def machine() -> dict:
  """Machine description: CPU model, core count, load average, library versions."""
  cpu = platform.processor()
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        if line.startswith("model name"):
          cpu = line.split(":", 1)[1].strip()
          break
  except OSError:
    pass
  info = {"cpu": cpu, "cores": os.cpu_count(), "loadavg": os.getloadavg(),
          "python": platform.python_version(),
          "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
  for mod in ("jax", "torch", "transformers", "rlax", "numpy"):
    try:
      info[mod] = __import__(mod).__version__
    except ImportError:
      pass
  try:
    import jax  # pylint: disable=import-outside-toplevel
    info["jax_devices"] = [str(d) for d in jax.devices()]
  except ImportError:
    pass
  return info


def measure_matmul_peak(n: int = 1024, repeats: int = 5, dtype: str = "float32") -> float:
  """Peak matmul FLOP/s of this device measured now: median time of a jitted ``[n,n]@[n,n]``
  (2 n^3 FLOP). Used as the MFU denominator."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  a = jnp.ones((n, n), dtype)
  f = jax.jit(jnp.dot)
  t = time_interleaved({"dot": lambda: f(a, a)}, warmup=2, repeats=repeats)["dot"]
  return 2.0 * n ** 3 / median(t)


def measure_bandwidth(nbytes: int = 256 << 20, repeats: int = 5) -> float:
  """Host memory read bandwidth (bytes/s) with every core reading: the larger median of a NumPy
  sum over ``nbytes`` of float32 (one thread) and a jitted ``jnp.sum`` of it (XLA:CPU reads with
  all its threads), each reading the array once. The decode bound uses this. (One NumPy thread
  alone reads ~12-14 GB/s on the 2-core development host, both cores ~22-24 GB/s: a one-thread
  probe halved the bound for an engine that uses both cores.)"""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  x = np.ones(nbytes // 4, np.float32)
  xj, total = jnp.asarray(x), jax.jit(jnp.sum)
  t = time_interleaved({"numpy": lambda: x.sum(), "xla": lambda: total(xj)}, warmup=1,
                       repeats=repeats)
  return nbytes / min(median(t["numpy"]), median(t["xla"]))


def measure_matmul_flops(n: int = 1024, repeats: int = 5) -> float:
  """Dense float32 matmul throughput of this host under XLA (FLOP/s): median time of a jitted
  [n, n] x [n, n] product (2 n^3 FLOPs). The compute side of the decode roofline."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  a = jnp.ones((n, n), jnp.float32)
  f = jax.jit(lambda x: x @ x)
  t = time_interleaved({"mm": lambda: f(a).block_until_ready()}, warmup=1, repeats=repeats)["mm"]
  return 2 * n ** 3 / median(t)


def peak_rss_bytes() -> int:
  """Peak resident set size of this process (VmHWM), bytes."""
  with open("/proc/self/status", encoding="utf-8") as f:
    for line in f:
      if line.startswith("VmHWM"):
        return int(line.split()[1]) * 1024
  return 0


def fmt(x) -> str:
  if isinstance(x, float):
    if x == 0 or 1e-3 <= abs(x) < 1e6:
      return f"{x:.4g}"
    return f"{x:.3e}"
  return str(x)


def markdown_table(rows: list[dict], columns: Sequence[str] | None = None) -> str:
  """Rows (dicts) -> a markdown table over ``columns`` (default: keys of the first row)."""
  if not rows:
    return "(no rows)\n"
  cols = list(columns or rows[0].keys())
  out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
  for r in rows:
    out.append("| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |")
  return "\n".join(out) + "\n"


def parser(description: str, malloc_flag: bool = False) -> argparse.ArgumentParser:
  """Argument parser with the common flags: ``--quick`` (smallest sizes, checks the script
  runs) and ``--json PATH`` (write results); with ``malloc_flag`` also
  ``--glibc_malloc_defaults`` (see ``apply_malloc``)."""
  ap = argparse.ArgumentParser(description=description)
  ap.add_argument("--quick", action="store_true", help="tiny sizes, 1 repeat: checks it runs")
  ap.add_argument("--json", default="", help="write {machine, rows} here")
  ap.add_argument("--repeats", type=int, default=5)
  if malloc_flag:
    ap.add_argument("--glibc_malloc_defaults", action="store_true",
                    help="skip sao_jax.host_malloc.keep_freed_memory() (the main job calls it)")
  return ap


def apply_malloc(args) -> bool:
  """Calls ``sao_jax.host_malloc.keep_freed_memory()`` as the main job does (the whole process:
  a torch peer in it gets the same allocator) unless ``--glibc_malloc_defaults``; returns
  whether the setting is on. Call it before JAX runs anything."""
  from sao_jax import host_malloc  # pylint: disable=import-outside-toplevel
  return False if args.glibc_malloc_defaults else host_malloc.keep_freed_memory()


def report(name: str, rows: list[dict], args, extra: dict | None = None) -> dict:
  """Prints the machine line and the table; writes JSON if ``args.json``. Returns the record."""
  rec = {"benchmark": name, "machine": machine(), "rows": rows, **(extra or {})}
  print(f"## {name}  ({rec['machine']['date']}, load {rec['machine']['loadavg']})")
  print(markdown_table(rows))
  if extra:
    print(json.dumps(extra, default=str))
  if getattr(args, "json", ""):
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(rec, f, indent=1, default=str)
  return rec


def uptime() -> str:
  try:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
  except OSError:
    return ""


def tunix_qwen3_config(cfg, **extra):
  """Tunix's ``tunix.models.qwen3.model.ModelConfig`` with the shapes of our ``ModelConfig``
  ``cfg`` (``extra``: further fields, e.g. ``dtype``); raises ImportError without tunix."""
  from tunix.models.qwen3 import model as tmodel  # pylint: disable=import-outside-toplevel
  return tmodel.ModelConfig(num_layers=cfg.n_layers, vocab_size=cfg.vocab_size,
                            embed_dim=cfg.d_model, hidden_dim=cfg.d_ff, num_heads=cfg.n_heads,
                            head_dim=cfg.head_dim, num_kv_heads=cfg.n_kv_heads,
                            rope_theta=int(cfg.rope_theta), norm_eps=cfg.rms_eps,
                            use_tied_embedding=cfg.tie_embeddings, **extra)


def learner_steps(graphdef, params, critic_graphdef, critic_params, lr: float, **train):
  """The main job's own jitted steps for a benchmark: a ``Learner`` on one device from
  ``configs/arith_tool.py`` (``train`` fields overridden; no critic lr warm-up), and its
  ``(learner, policy_step(state, batch, advantages, None), critic_step(state, batch,
  targets))``."""
  # pylint: disable-next=import-outside-toplevel  (jax-free module top)
  from sao_jax import configs, roles
  from sao_jax.train.learner import Learner, LearnerConfig  # pylint: disable=import-outside-toplevel
  cfg = LearnerConfig.from_run(roles.from_config(configs.load("arith_tool")), policy_lr=lr,
                               critic_lr=lr, critic_lr_warmup_steps=0, **train)
  learner = Learner(cfg, graphdef, params, critic_graphdef, critic_params, pad_id=0)
  _, critic_step, policy_step, _, _ = learner.jitted_steps()
  return learner, policy_step, critic_step

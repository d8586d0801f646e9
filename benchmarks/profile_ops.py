"""Where a jitted train step's time goes, op by op: a ``jax.profiler`` trace of the step on
XLA:CPU, its op events summed per source function (the innermost ``sao_jax`` frame of each HLO
op, forward vs backward), per op kind, and the top ops; plus CPU / kernel time, minor page
faults per step and XLA's temp buffer size.

    python benchmarks/profile_ops.py [--config tiny] [--step policy|critic] [--repeats 10]

Op event durations include the tracer's own per-op overhead (sums run ~1-2x the untraced
step), so read the shares, not the absolute milliseconds; the CPU time / faults columns come
from ``getrusage`` over untraced steps.
"""

from __future__ import annotations

import collections
import glob
import re
import resource
import tempfile
import time

import common  # pylint: disable=import-error
import jax
import jax.numpy as jnp
from flax import nnx

import bench_train_step as bts  # pylint: disable=import-error
from sao_jax.models.transformer import Critic, Transformer
from sao_jax.train.batch import Batch


def _stack_frames(hlo_text: str):
  """Parses the FileNames / FunctionNames / FileLocations / StackFrames tables that
  ``compiled.as_text()`` appends; returns ``where(frame_id) -> 'function'`` naming the innermost
  ``sao_jax`` function ('optax' for optimizer code, '?' when unknown)."""
  tables = {"FileNames": {}, "FunctionNames": {}, "FileLocations": {}, "StackFrames": {}}
  sec = None
  for line in hlo_text.splitlines():
    if line in tables:
      sec = line
      continue
    m = re.match(r"(\d+) (.*)$", line) if sec else None
    if not m:
      sec = None
      continue
    tables[sec][int(m.group(1))] = m.group(2)
  files = {i: v.strip('"') for i, v in tables["FileNames"].items()}
  funcs = {i: v.strip('"') for i, v in tables["FunctionNames"].items()}
  field = lambda s, k: int(re.search(k + r"=(\d+)", s).group(1))
  locs = {i: (files.get(field(v, "file_name_id"), ""), funcs.get(field(v, "function_name_id"), ""))
          for i, v in tables["FileLocations"].items()}
  frames = {i: (field(v, "file_location_id"), field(v, "parent_frame_id"))
            for i, v in tables["StackFrames"].items()}

  def where(fid: int) -> str:
    for _ in range(64):  # parent ids are 1-based: parent_frame_id - 1 is the caller's frame
      if fid not in frames:
        return "?"
      path, func = locs.get(frames[fid][0], ("", ""))
      if "/sao_jax/" in path:
        return func
      if "/optax/" in path:
        return "optax (optimizer)"
      fid = frames[fid][1] - 1
    return "?"
  return where


def _op_index(hlo_text: str, where):
  """HLO op name -> (shape, 'forward'|'backward'|'-', source function)."""
  idx = {}
  for line in hlo_text.splitlines():
    m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (\S+) [\w\-]+\(", line)
    if not m:
      continue
    op_name = re.search(r'op_name="([^"]*)"', line)
    op_name = op_name.group(1) if op_name else ""
    phase = "backward" if "transpose(" in op_name else "forward" if "jvp(" in op_name else "-"
    frame = re.search(r"stack_frame_id=(\d+)", line)
    idx[m.group(1)] = (m.group(2), phase, where(int(frame.group(1))) if frame else "?")
  return idx


def trace_ops(run, n: int) -> collections.Counter:
  """Traces ``n`` calls of ``run()`` with ``jax.profiler``; returns ``{HLO op name: traced ms per
  call}`` (XLA:CPU op events; the Python line and thread-pool bookkeeping left out)."""
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d):
      for _ in range(n):
        run()
    data = jax.profiler.ProfileData.from_file(glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0])
  per_op = collections.Counter()
  for plane in data.planes:
    for line in plane.lines:
      if line.name == "python":
        continue
      for ev in line.events:
        if not ev.name.startswith(("ThunkExecutor", "SlinkyThreadPool")):
          per_op[ev.name] += ev.duration_ns / 1e6 / n
  return per_op


def _kind(op: str) -> str:
  if op.startswith("ynn_fusion"):
    return "YNNPACK fusion (dot / reduce)"
  if re.match(r"dot(\.\d+)?$", op):
    return "dot (Eigen)"
  if op.startswith(("copy", "transpose")):
    return "copy / transpose fusion"
  return "other fusion / op" if "fusion" in op else "other: " + re.sub(r"[.\d]+$", "", op)


def main():
  ap = common.parser(__doc__, malloc_flag=True)
  ap.add_argument("--config", default="tiny")
  ap.add_argument("--step", default="policy", choices=("policy", "critic"))
  ap.add_argument("--top", type=int, default=15)
  args = ap.parse_args()
  common.apply_malloc(args)
  cfg = bts.CONFIGS[args.config]
  b, t = (2, 32) if args.quick else (8, 256)
  n = 2 if args.quick else args.repeats
  np_batch = bts.make_batch(cfg, b, t)
  batch = Batch.of(np_batch["tokens"], np_batch["action_mask"],
                   rollout_logprobs=np_batch["rollout_logprobs"])
  graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
  c_graphdef, c_params = nnx.split(Critic(cfg, rngs=nnx.Rngs(1)))
  learner, p_step, c_step = common.learner_steps(graphdef, nnx.to_pure_dict(params), c_graphdef,
                                                 nnx.to_pure_dict(c_params), 1e-5)
  if args.step == "policy":  # the main job's jitted steps (train/learner.py)
    step, metric = p_step, "policy_loss"
    extra = (jnp.asarray(np_batch["advantages"]), None)
    state = {"s": learner.policy}
  else:
    step, metric = c_step, "value_loss"
    extra = ({"returns": jnp.asarray(np_batch["returns"]),
              "values": jnp.asarray(np_batch["values"])},)
    state = {"s": learner.critic}
  compiled = step.lower(state["s"], batch, *extra).compile()
  text = compiled.as_text()
  temp_mb = compiled.memory_analysis().temp_size_in_bytes / 2**20

  def run():
    state["s"], m = step(state["s"], batch, *extra)
    return jax.block_until_ready(m[metric])

  for _ in range(3):
    run()
  r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
  for _ in range(n):
    run()
  r1, wall = resource.getrusage(resource.RUSAGE_SELF), (time.perf_counter() - t0) / n
  usage = {"wall ms/step": wall * 1e3,
           "CPU ms/step (user+sys)": (r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime)
                                     / n * 1e3,
           "kernel (sys) ms/step": (r1.ru_stime - r0.ru_stime) / n * 1e3,
           "minor page faults/step": (r1.ru_minflt - r0.ru_minflt) / n,
           "XLA temp buffer MB": temp_mb}

  per_op = trace_ops(run, n)
  idx = _op_index(text, _stack_frames(text))
  total = sum(per_op.values())
  by_src = collections.defaultdict(lambda: [0.0, 0])
  by_kind = collections.defaultdict(lambda: [0.0, 0])
  for op, ms in per_op.items():
    _, phase, src = idx.get(op, ("", "-", "runtime"))
    for table, key in ((by_src, f"{src} [{phase}]"), (by_kind, _kind(op))):
      table[key][0] += ms
      table[key][1] += 1
  rows = lambda tab: [{"part": k, "traced ms/step": v[0], "share": v[0] / total, "ops": v[1]}
                      for k, v in sorted(tab.items(), key=lambda kv: -kv[1][0])]
  name = f"profile_ops ({args.config} {args.step} step, {b}x{t})"
  common.report(f"{name}: by source function", rows(by_src)[:args.top], args, usage)
  common.report(f"{name}: by op kind", rows(by_kind)[:8], argparse_no_json(args))
  top = [{"op": op, "shape": idx.get(op, ("?",))[0],
          "where": " ".join(idx.get(op, ("", "", ""))[1:]), "traced ms/step": ms,
          "share": ms / total}
         for op, ms in per_op.most_common(args.top)]
  common.report(f"{name}: top ops", top, argparse_no_json(args))


def argparse_no_json(args):
  """``args`` with ``--json`` cleared (only the first table is written to the JSON file)."""
  return type(args)(**{**vars(args), "json": ""})


if __name__ == "__main__":
  main()

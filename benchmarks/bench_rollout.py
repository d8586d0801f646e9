"""Rollout only: the multi-turn tool task of the main job, ``configs/arith_tool.py``, through the
real ``RolloutWorker`` (continuous batching, one ``<tool>`` call and observation per turn, the
env inline), on two engine paths in one process, interleaved:

    python benchmarks/bench_rollout.py [--quick] [--problems 256] [--repeats 3] [--json out.json]
                                       [--paths ours,ours+overlap]

- "ours": the worker's default path on ``SAOEngine`` -- a fresh prompt and every observation
  prefilled straight into its decode slot (``prefill_insert``, ``starts=`` for observations),
  ``rollout.decode_steps`` tokens per ``generate_steps`` call.
- "ours@N" (N = the core count, when above 1): the same path on an engine whose slots are split
  over N host devices (``SAOEngine(mesh=)``; the process starts with
  ``--xla_force_host_platform_device_count`` = the core count unless ``XLA_FLAGS`` sets one). It
  draws the same tokens as "ours" (same seed in each round), so the two roll out the same
  trajectories.
- "ours+overlap": "ours" with ``rollout.overlap_host`` (the next ``generate_steps`` call is
  dispatched before the host reads the previous one's tokens; same seed as "ours", but a slot
  rejoins one call later after each turn, so the draws differ).
- "jetstream_api": the same engine seen through the JetStream API only (``prefill`` /
  ``insert`` / ``generate`` / ``slot_prefix``: a one-row prefill per prompt or observation,
  inserted into the slot, one token per call), the path any other JetStream engine takes.

Both roll out the same ``--problems`` training problems with the same SFT warm start (the main
job's, ``sft.steps`` demonstrations steps, cached under ``--sft_cache``) at temperature 1. The
draws differ between the paths (different key splits), so each reports its own token count:
"action tok/s" = sampled policy tokens kept in trajectories / wall seconds, and the ratio
compares those rates. ``prefill_s`` and ``generate_s`` are the worker's own timers (device time
included). The first full run trains the SFT warm start before timing anything (~3 min on 2
cores), and later runs load it from ``--sft_cache``. With ``--quick``, a random init (no SFT) on
16 problems: a wiring check whose ratio means nothing.
"""

from __future__ import annotations

import os
import tempfile
import time

import common  # pylint: disable=import-error

common.one_xla_device_per_core()  # before JAX starts
import jax  # pylint: disable=wrong-import-position
import numpy as np

from configs import arith_tool
from sao_jax import build, roles, tasks
from sao_jax.rollout.sync import WeightStore
from sao_jax.rollout.worker import RolloutWorker


class JetStreamOnly:
  """An engine proxy without ``prefill_insert`` / ``generate_steps``: the worker then takes
  the JetStream-API path (``RolloutWorker._batched`` is False)."""

  _HIDDEN = ("prefill_insert", "generate_steps")

  def __init__(self, engine):
    self._engine = engine

  def __getattr__(self, name):
    if name in self._HIDDEN:
      raise AttributeError(name)
    return getattr(self._engine, name)


def main():
  ap = common.parser(__doc__, malloc_flag=True)
  ap.add_argument("--problems", type=int, default=256)
  ap.add_argument("--sft_cache", default=os.path.join(tempfile.gettempdir(), "sao_jax_sft_cache"),
                  help="sft.cache_dir: the warm start is trained once and reused")
  ap.add_argument("--paths", default="",
                  help="comma-separated paths to run (default: all; module doc)")
  args = ap.parse_args()
  malloc_tuned = common.apply_malloc(args)
  c = arith_tool.get_config()
  c.sft.cache_dir = args.sft_cache
  c = roles.from_config(c)
  n = 16 if args.quick else args.problems
  repeats = 1 if args.quick else args.repeats
  task = tasks.make_task(c)
  policy = build.build_policy(c, task, warm_start=not args.quick)
  engine = build.make_engine(c, policy.mcfg, policy.graphdef, task.tokenizer,
                             slots=c.rollout.slots, temperature=1.0)
  problems = task.train_problems[:n]
  paths = {"ours": (engine, policy.params), "ours+overlap": (engine, policy.params)}
  ndev = len(jax.devices())
  if ndev > 1 and c.rollout.slots % ndev == 0:
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    paths[f"ours@{ndev}"] = (
        build.make_engine(c, policy.mcfg, policy.graphdef, task.tokenizer,
                          slots=c.rollout.slots, temperature=1.0, mesh=mesh),
        jax.device_put(policy.params, jax.sharding.NamedSharding(
            mesh, jax.sharding.PartitionSpec())))
  paths["jetstream_api"] = (JetStreamOnly(engine), policy.params)
  keep = set(args.paths.split(",")) if args.paths else set(paths)
  if keep - set(paths):
    raise ValueError(f"--paths: unknown {sorted(keep - set(paths))}; choose from {list(paths)}")
  stats = {name: [] for name in paths if name in keep}

  def rollout(name, seed):
    out = []
    eng, params = paths[name]
    eng.reseed(seed)
    worker = RolloutWorker(
        eng, task.env, iter(problems),
        lambda t: out.append(t) or True, WeightStore(params, 0), stop_ids=task.stop_ids,
        stop_strings=task.stop_strings, max_new_tokens=c.rollout.max_new_tokens,
        max_seq_len=c.model.max_seq_len, temperature=1.0, seed=seed,
        decode_steps=1 if name == "jetstream_api" else c.rollout.decode_steps,
        overlap_host=name == "ours+overlap")
    t0 = time.perf_counter()
    worker.run()
    wall = time.perf_counter() - t0
    if len(out) != n:
      raise RuntimeError(f"{name}: {len(out)} trajectories for {n} problems")
    stats[name].append({"wall": wall, "tokens": sum(int((t.action_mask > 0).sum()) for t in out),
                        "turns": float(np.mean([t.num_turns for t in out])),
                        "prefill_s": worker.stats.prefill_s,
                        "generate_s": worker.stats.generate_s,
                        "overlapped calls": worker.stats.overlapped_calls,
                        "prefill calls": getattr(worker.stats, "prefill_calls", -1),
                        # decode slot-steps that sampled a kept token (the rest: empty slots,
                        # slots awaiting their env, tokens past a turn's end)
                        "busy slot-steps": (worker.stats.decode_slot_steps
                                            - worker.stats.tokens_discarded)
                                           / max(1, worker.stats.generate_steps
                                                 * c.rollout.slots)})

  for r in range(1 + repeats):  # round 0 compiles; the paths take turns in every round
    for name in stats:  # the "ours" paths share a seed in each round: the same draws
      rollout(name, 10 * r + (2 if name == "jetstream_api" else 1))
  rows = []
  for name, runs in stats.items():
    runs = runs[1:]
    rate = [r["tokens"] / r["wall"] for r in runs]
    rows.append({"path": name, "trajectories": n, "action tok/s": common.median(rate),
                 "wall s": common.median([r["wall"] for r in runs]),
                 "action tokens": common.median([r["tokens"] for r in runs]),
                 "turns / trajectory": common.median([r["turns"] for r in runs]),
                 "prefill_s": common.median([r["prefill_s"] for r in runs]),
                 "generate_s": common.median([r["generate_s"] for r in runs]),
                 "overlapped calls": common.median([r["overlapped calls"] for r in runs]),
                 "prefill calls": common.median([r["prefill calls"] for r in runs]),
                 "busy slot-steps": common.median([r["busy slot-steps"] for r in runs])})
  for row in rows[:-1] if "jetstream_api" in stats else []:
    row["/ jetstream_api"] = row["action tok/s"] / rows[-1]["action tok/s"]
  common.report("rollout (configs/arith_tool.py, " + ("quick: random init" if args.quick
                                                      else "SFT warm start") + ")", rows, args,
                {"problems": n, "slots": c.rollout.slots, "decode_steps": c.rollout.decode_steps,
                 "host_malloc.keep_freed_memory": malloc_tuned})


if __name__ == "__main__":
  main()

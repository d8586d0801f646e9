"""The main job at SmolLM2-135M's shape on one accelerator: `configs/smollm2_arith.py:accelerator`
for a few policy steps; step time, tokens/s, peak device memory and the learner's MFU.

    python benchmarks/accelerator_smollm2.py prepare DIR          # here, once (no weights: ~3 MB)
    python benchmarks/accelerator_smollm2.py run DIR --out OUT    # on the accelerator host

``prepare`` writes a Hugging Face folder holding SmolLM2-135M-Instruct's ``config.json`` and its
tokenizer (``tokenizer.json`` + ``tokenizer_config.json`` with the ChatML template), read from the
packaged GGUF, but no weights: the GGUF (98 MB) is too large to travel to a lent accelerator here.
``run`` fills the folder with random weights of that shape (``Transformer`` init, seed 0; time
and memory do not depend on the values, but the rewards and the responses' lengths do: a random
model samples every turn to ``rollout.max_new_tokens``), then runs the main job once per
``--variants`` entry, each in a fresh process so its peak device memory is its own:

* ``f32``: the config as written (float32 parameters and compute);
* ``bf16``: ``model.param_dtype`` and ``model.dtype`` bfloat16 (the learner keeps its float32
  master, as ``configs/aime.py`` runs).

A variant starts only while ``--budget_s`` seconds remain. Per variant ``OUT/accelerator_<v>.json``
holds the per-step metrics (``train_s``, ``wait_s``, ``tokens_per_s``), the seconds to the first
step (compiles), the device's ``peak_bytes_in_use`` and the learner's model FLOPs per step
(``sao_jax.plan.learner_flops``, traced on the CPU backend: targets + K critic updates + the
policy update) divided by the median ``train_s`` and ``--peak_tflops`` -- the learner's MFU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

VARIANTS = {
    "f32": {},
    "bf16": {"model.param_dtype": "bfloat16", "model.dtype": "bfloat16"},
}


def prepare(folder: str) -> None:
  """Writes config.json, tokenizer.json and tokenizer_config.json of the packaged SmolLM2."""
  from sao_jax.data.hf_tokenizer import HFTokenizer
  from sao_jax.models import gguf_loader, hf
  os.makedirs(folder, exist_ok=True)
  reader = gguf_loader.GGUFReader(gguf_loader.resolve_gguf_path("smollm2"))
  cfg = gguf_loader.config_from_gguf(reader)
  with open(os.path.join(folder, "config.json"), "w") as f:
    json.dump(hf.config_to_hf(cfg), f, indent=1)
  tok = HFTokenizer.from_gguf("smollm2")
  tok._tok.save(os.path.join(folder, "tokenizer.json"))  # pylint: disable=protected-access
  with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
    json.dump({"chat_template": tok.chat_template, "eos_token": tok.eos_token,
               "bos_token": tok.bos_token, "pad_token": tok.pad_token}, f, indent=1)
  print(f"wrote {sorted(os.listdir(folder))} to {folder}")


def random_weights(folder: str) -> None:
  """model.safetensors of random float32 weights with config.json's shape (seed 0)."""
  if os.path.exists(os.path.join(folder, "model.safetensors")):
    return
  from flax import nnx
  from sao_jax.models import hf
  from sao_jax.models.transformer import Transformer
  cfg = hf.config_from_hf(hf.read_hf_config(folder))
  _, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
  hf.save_hf_checkpoint(folder, cfg, nnx.to_pure_dict(params),
                        hf_config=hf.read_hf_config(folder))


def config_for(folder: str, variant: str, steps: int, run_dir: str, sets=()):
  """The `:accelerator` config on ``folder``'s weights, ``steps`` policy steps, short evals;
  ``sets``: more ``key=value`` overrides (values parsed as JSON, else kept as strings)."""
  from sao_jax import configs
  c = configs.load("smollm2_arith", "accelerator")
  c.model.gguf, c.model.checkpoint_dir = "", folder
  c.run_dir = run_dir
  c.train.num_steps = steps
  c.train.critic_warmup_steps = 2          # value pre-training: 2 critic-only batches
  c.task.n_eval = 50                       # before / after evals only (random weights)
  c.eval.every_steps = 0
  c.checkpoint.every_steps = 0
  c.log.tensorboard = False
  c.log.progress = "lines"
  extra = {}
  for kv in sets:
    key, value = kv.split("=", 1)
    try:
      extra[key] = json.loads(value)
    except json.JSONDecodeError:
      extra[key] = value
  for key, value in {**VARIANTS[variant], **extra}.items():
    node = c
    *parents, leaf = key.split(".")
    for p in parents:
      node = node[p]
    node[leaf] = value
  return c


def child(folder: str, variant: str, steps: int, out: str, run_root: str, sets=()) -> None:
  """One variant in this process: the main job, then the device's peak memory, as JSON."""
  import jax
  from sao_jax import host_malloc
  from sao_jax.train import loop
  host_malloc.keep_freed_memory()
  run_dir = os.path.join(run_root, f"run_{variant}")
  t0 = time.time()
  summary = loop.run(config_for(folder, variant, steps, run_dir, sets))
  wall = time.time() - t0
  dev = jax.devices()[0]
  stats = dev.memory_stats() or {}
  rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
  steps_rows = [r for r in rows if "train_s" in r and r.get("policy_version") is not None]
  keep = ("step", "policy_version", "train_s", "wait_s", "tokens_per_s", "elapsed_s",
          "action_tokens", "response_tokens_generated_mean", "staleness_mean", "policy_loss",
          "value_loss", "masked_fraction")
  result = dict(
      variant=variant, device=str(dev.device_kind), platform=dev.platform,
      jax=jax.__version__, wall_s=wall, summary={k: v for k, v in summary.items()
                                                 if isinstance(v, (int, float, str))
                                                 and k != "metrics_csv"},  # a device path
      peak_bytes_in_use=stats.get("peak_bytes_in_use"), bytes_limit=stats.get("bytes_limit"),
      steps=[{k: r.get(k) for k in keep} for r in steps_rows])
  with open(os.path.join(out, f"accelerator_{variant}.json"), "w") as f:
    json.dump(result, f, indent=1, default=str)


def learner_step_flops(folder: str, variant: str, sets=()) -> float:
  """Model FLOPs of one learner step (targets + K critic updates + policy update), whole batch."""
  from sao_jax import plan, roles
  config = config_for(folder, variant, 1, "runs/accelerator_flops", sets)  # nothing is written
  run = roles.from_config(config)
  mcfg = plan.model_config(config)
  f = plan.learner_flops(config, mcfg, rows=run.train.batch_size)
  return f["targets"] + run.train.critic_updates_per_step * f.get("critic", 0.0) + f["policy"]


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("command", choices=("prepare", "run", "child"))
  ap.add_argument("folder")
  ap.add_argument("--out", default="benchmarks/results/accelerator")
  ap.add_argument("--variants", default="f32,bf16")
  ap.add_argument("--run_root", default=os.path.join(tempfile.gettempdir(), "accelerator_runs"),
                  help="the runs' folders (metrics, the end-of-run checkpoint)")
  ap.add_argument("--variant", default="f32", help=argparse.SUPPRESS)
  ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                  help="a config override, e.g. --set train.batch_size=8 (repeatable)")
  ap.add_argument("--steps", type=int, default=8, help="policy steps per variant")
  ap.add_argument("--budget_s", type=float, default=420.0,
                  help="start a variant only while this many seconds remain")
  ap.add_argument("--min_left_s", type=float, default=170.0,
                  help="seconds a variant needs (compiles and steps)")
  ap.add_argument("--peak_tflops", type=float, default=989.0,
                  help="the chip's dense bf16 peak (H100/H200 SXM datasheet: 989)")
  args = ap.parse_args()
  if args.command == "prepare":
    prepare(args.folder)
    return
  if args.command == "child":
    child(args.folder, args.variant, args.steps, args.out, args.run_root, args.set)
    return
  t_start = time.time()
  os.makedirs(args.out, exist_ok=True)
  random_weights(args.folder)
  print(f"random weights ready after {time.time() - t_start:.1f} s", flush=True)
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONUNBUFFERED="1")
  for v in args.variants.split(","):
    left = args.budget_s - (time.time() - t_start)
    if left < args.min_left_s:
      print(f"skipping {v}: {left:.0f} s left", flush=True)
      continue
    print(f"=== variant {v} ({left:.0f} s left)", flush=True)
    cmd = [sys.executable, os.path.abspath(__file__), "child", args.folder, "--variant", v,
           "--steps", str(args.steps), "--out", args.out, "--run_root", args.run_root,
           *[a for kv in args.set for a in ("--set", kv)]]
    try:
      rc = subprocess.run(cmd, env=env, timeout=max(left - 10, 30), check=False).returncode
    except subprocess.TimeoutExpired:
      print(f"variant {v} ran out of time", flush=True)
      continue
    print(f"variant {v} exit {rc}", flush=True)
  for v in args.variants.split(","):
    path = os.path.join(args.out, f"accelerator_{v}.json")
    if not os.path.exists(path):
      continue
    with open(path) as f:
      r = json.load(f)
    steps = [s for s in r["steps"] if s.get("train_s") is not None]
    later = steps[2:] or steps
    train_s = statistics.median(s["train_s"] for s in later)
    try:
      flops = learner_step_flops(args.folder, v, args.set)
    except Exception as e:  # pylint: disable=broad-except
      print(f"FLOPs count failed: {e!r}")
      flops = float("nan")
    r.update(learner_step_tflop=flops / 1e12, median_train_s=train_s,
             median_wait_s=statistics.median(s["wait_s"] or 0 for s in later),
             median_tokens_per_s=statistics.median(s["tokens_per_s"] or 0 for s in later),
             learner_mfu=flops / train_s / (args.peak_tflops * 1e12))
    with open(path, "w") as f:
      json.dump(r, f, indent=1, default=str)
    print(json.dumps({k: r[k] for k in ("variant", "device", "jax", "wall_s", "median_train_s",
                                        "median_wait_s", "median_tokens_per_s",
                                        "learner_step_tflop", "learner_mfu",
                                        "peak_bytes_in_use")}, default=str), flush=True)


if __name__ == "__main__":
  main()

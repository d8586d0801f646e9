"""SAO on the CPU-sized tool-integrated arithmetic task (the main job's default).

`python -m sao_jax.main --config=configs/arith_tool.py`; override any field on the command line,
e.g. `--config.train.num_steps=10`. Variant `configs/arith_tool.py:smoke` runs a few steps only.
Every field's default, doc and allowed values are declared once, in `sao_jax/roles.py` (listed in
docs/config.md); this task's config is those defaults.
"""

import ml_collections

from sao_jax import roles


def get_config(variant: str = "") -> ml_collections.ConfigDict:
  c = roles.default_config()
  c.run_dir = "runs/arith_tool"   # metrics.jsonl/.csv, results.csv, tb/, checkpoints/

  if variant == "smoke":
    c.task.n_train, c.task.n_eval = 64, 16
    c.sft.steps, c.sft.num_demos = 20, 64
    c.rollout.slots, c.eval.slots = 8, 16
    c.train.num_steps, c.train.batch_size = 3, 8
    c.train.critic_warmup_steps = 2
    c.eval.every_steps, c.checkpoint.every_steps = 2, 2
    c.run_dir = "runs/arith_tool_smoke"
    c.rollout.kv_bucket = c.model.max_seq_len  # fewest compiles (a wiring check): one decode
    c.rollout.prefill_rows = "all"             # program per shape, one prefill per length
  elif variant:
    raise ValueError(f"unknown variant {variant!r} of configs/arith_tool.py; use '' or 'smoke'.")
  return c

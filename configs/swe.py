"""SAO in the paper's agentic-coding setting: SWE-bench-style instances in the repository-editing
environment (sao_jax/envs/workspace.py: view / replace / create / test / finish tool calls, tests
in the sandbox, reward 1 when the hidden FAIL_TO_PASS and PASS_TO_PASS tests pass), with the
paper's coding hyper-parameters: DIS band eps_low 0.8 / eps_high 3.0, long contexts, many turns.

`python -m sao_jax.main --config=configs/swe.py --config.model.checkpoint_dir=/path/to/ckpt
--config.task.train_file=/path/to/instances.jsonl [--config.task.eval_file=...]` needs a policy
checkpoint (as configs/aime.py) and SWE-bench-format instances (docs/coding.md: the JSONL schema,
and what real repositories need -- the default backend runs tests with the standard library only).
Without either it stops at once and says which field to set. Derived from configs/aime.py
(precision, mesh, remat, optimiser as there); the memory plan of the longer rows has not been
checked: run `python -m sao_jax.plan --config=configs/swe.py ...` before paying for a slice.
`--config=configs/swe.py:smoke` runs the data path end to end on the generated swe_lite instances
with a tiny random model for two steps (a wiring check, not a result).
"""

import ml_collections

from sao_jax import configs


def get_config(variant: str = "") -> ml_collections.ConfigDict:
  c = configs.load("aime")
  c.run_dir = "runs/swe"
  c.task.name = "swe"                 # SWE-bench-format JSONL in the workspace env
  c.task.train_file = ""              # REQUIRED: instances JSONL (or 'swe_lite:train')
  c.task.eval_file = ""               # held-out JSONL ('' = the last n_eval of train_file)
  c.task.n_train = 100000             # every instance of train_file
  c.task.n_eval = 100
  c.eval.periodic_problems = 100      # the whole held-out set in the periodic eval
  c.task.max_turns = 50               # many tool turns per episode
  c.task.tool_cpu_s = 60              # sandbox CPU seconds per test run
  c.task.tool_wall_s = 120.0          # sandbox wall seconds per test run
  c.task.tool_memory_mb = 4096        # sandbox address space per test run (MiB)
  c.task.tool_output_chars = 4096     # observation cut: file views and test logs
  c.task.system_prompt = ""           # '' = workspace.INSTRUCTION (the tool formats)
  c.rollout.env_timeout_s = 150.0     # > tool_wall_s + sandbox start-up

  c.model.max_seq_len = 16384         # long context: the whole multi-turn episode
  c.mesh.tokens_per_device = 16384    # one episode row per device per micro-batch
  c.rollout.max_new_tokens = 2048     # response budget per turn
  c.rollout.max_prefill_length = 8192 # prompt / one observation chunk

  c.train.eps_low = 0.8               # paper, coding agent
  c.train.eps_high = 3.0              # paper, coding agent

  if variant == "smoke":
    c.run_dir = "runs/swe_smoke"
    c.task.train_file = "swe_lite:train"  # the generated instances stand in for SWE-bench
    c.task.eval_file = "swe_lite:eval"
    c.task.n_train, c.task.n_eval = 16, 4
    c.task.max_turns = 4
    c.task.tool_cpu_s, c.task.tool_wall_s, c.task.tool_memory_mb = 2, 10.0, 256
    c.task.tool_output_chars = 600
    c.rollout.env_timeout_s = 30.0
    c.train.critic_warmup_steps = 0   # a wiring check: no value pre-training
    c.model.checkpoint_dir = ""       # tiny random model instead of a checkpoint
    c.model.param_dtype, c.model.dtype = "float32", "float32"
    c.model.remat, c.model.scan_layers = "none", False
    c.model.d_model, c.model.n_layers, c.model.d_ff = 32, 1, 64
    c.model.n_heads, c.model.n_kv_heads, c.model.head_dim = 2, 1, 16
    c.model.max_seq_len = 1024
    c.mesh.tokens_per_device = 4096
    c.rollout.max_new_tokens = 16
    c.rollout.max_prefill_length = 640
    c.rollout.slots, c.eval.slots = 4, 4
    c.rollout.env_workers = 4
    c.train.batch_size, c.train.num_steps = 4, 2
    c.eval.every_steps, c.checkpoint.every_steps = 0, 0
    c.train.policy_lr, c.train.critic_lr = 1e-4, 1e-4
    c.allow_random_init = True        # only the smoke variant may run without a checkpoint
    c.rollout.kv_bucket = c.model.max_seq_len  # fewest compiles (a wiring check): one decode
    c.rollout.prefill_rows = "all"             # program per shape, one prefill per length
  elif variant:
    raise ValueError(f"unknown variant {variant!r} of configs/swe.py; use '' or 'smoke'.")
  return c

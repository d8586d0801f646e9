"""SAO in the paper's math setting: tool-integrated reasoning (the policy writes Python, a sandbox
runs it, the output comes back as observation tokens, up to 50 turns), math-verify reward on the
final \\boxed{}, paper hyper-parameters. Trains on the packaged training mix (GSM8K train,
MATH-500, AIME 2024, AMC 2023, HMMT Feb 2024: `sao_jax/data/split.py`), which shares no problem
with the evaluation sets; evaluates on AIME 2025 during training, and on the paper's four
benchmarks with `python -m sao_jax.eval --config=configs/aime.py --protocol=paper`
(docs/tir_math.md).

`python -m sao_jax.main --config=configs/aime.py --config.model.checkpoint_dir=/path/to/ckpt`
needs a policy checkpoint: a Hugging Face folder (`config.json`, `model.safetensors` or sharded
`model-*.safetensors` + index, `tokenizer.json`, `tokenizer_config.json` with the chat template;
e.g. Qwen3-30B-A3B) loaded by `sao_jax.models.hf`, or an orbax checkpoint written by sao_jax
(`<run_dir>/checkpoints`). With a Hugging Face folder the prompts go through its chat template.
Without one it stops at once and says which field to set.
Sized for Qwen3-30B-A3B on a v5p-64 (32 chips, fsdp=32): with block remat, a scan over the
layers and micro-batches of one 4096-token row per chip, every learner program plans at 72 GiB
per chip of 95, the engine at 87.5 GiB (prefill) on one chip (docs/scale.md; `python -m
sao_jax.plan --config=configs/aime.py --model=qwen3-30b-a3b --topology=v5p-64`). With 2 rows
per micro-batch (`mesh.tokens_per_device=8192`) the learner needs 103 GiB and does not fit.
`--config=configs/aime.py:smoke` runs the AIME data path end to end with a tiny random model
for two steps (a wiring check, not a result).
"""

import ml_collections

from sao_jax import configs



def get_config(variant: str = "") -> ml_collections.ConfigDict:
  c = configs.load("arith_tool")
  c.run_dir = "runs/aime"
  c.task.name = "tir_math"            # multi-turn, sandboxed Python tool (envs/tir_math.py)
  c.task.train_file = "paper_mix"     # data/split.py TRAIN_MIX: 8,073 problems, none evaluated
  c.task.eval_file = "aime25.jsonl"   # held-out: the 30 AIME 2025 problems (periodic eval)
  c.task.n_eval = 30
  c.task.max_turns = 50               # paper: up to 50 tool turns
  c.task.tool_cpu_s = 5               # sandbox CPU seconds per program run
  c.task.tool_wall_s = 10.0           # sandbox wall-clock seconds per program run
  c.task.tool_memory_mb = 1024        # sandbox address-space limit per program run (MiB)
  c.task.tool_output_chars = 1024     # observation cut (first + last 512 characters)
  c.rollout.env_timeout_s = 30.0      # > tool_wall_s + sandbox start-up

  c.allow_random_init = False         # refuse to start RL from a random model
  c.model.checkpoint_dir = ""         # REQUIRED: HF checkpoint folder or sao_jax orbax checkpoint
  c.model.param_dtype = "bfloat16"    # stored / served dtype (checkpoint load, the engine's
                                      # weights); the learner trains float32 master params with
                                      # float32 Adam moments whatever it is
  c.model.dtype = "bfloat16"          # compute dtype of the forward / backward passes
  c.model.max_seq_len = 4096          # prompt (character tokens) + response
  c.sft.steps = 0                     # no warm-up: the checkpoint is the starting policy

  c.rollout.temperature = 1.0         # paper: sampling temperature 1.0, top-p 1.0
  c.rollout.max_new_tokens = 2048     # response budget per turn
  c.rollout.max_prefill_length = 2048 # prompt tokens (longest AIME 2025 problem: 1,895 characters)
  c.rollout.slots = 32
  c.rollout.env_workers = 32          # sandbox runs off the decode loop: a slow program stalls
                                      # only its slot (auto (-1) only sees tool_latency_median_s)
  c.rollout.queue_size = 256

  c.train.batch_size = 128            # paper: 128 trajectories per policy step, 1 per prompt
  c.train.num_steps = 1000            # paper: SAO stable to 1,000 steps
  c.train.policy_lr = 1e-6            # paper
  c.train.critic_lr = 5e-6            # paper
  c.train.critic_lr_warmup_steps = 10 # paper: critic "10-step warmup"
  c.train.critic_updates_per_step = 2 # paper: K = 2
  c.train.eps_low = 0.3               # paper, math / tool setting
  c.train.eps_high = 5.0              # paper, math / tool setting
  c.eval.every_steps = 50
  c.eval.periodic_problems = 30
  c.checkpoint.every_steps = 50
  c.mesh.shape = "fsdp=-1"            # FSDP over every device (1 CPU ... a pod): no code change
  c.mesh.tokens_per_device = 4096     # micro-batches of 1 x 4096-token row per device
  c.model.remat = "block"             # keep one input per block for the backward pass
  c.model.scan_layers = True          # one lax.scan over the 48 layers (compile time flat in depth)

  if variant == "smoke":
    c.run_dir = "runs/aime_smoke"
    c.train.critic_warmup_steps = 0     # a wiring check: no value pre-training
    c.model.checkpoint_dir = ""       # tiny random model instead of a checkpoint
    c.model.param_dtype, c.model.dtype = "float32", "float32"
    c.mesh.tokens_per_device = 8192   # the tiny model's smoke as before these defaults
    c.model.remat, c.model.scan_layers = "none", False
    c.model.d_model, c.model.n_layers, c.model.d_ff = 32, 1, 64
    c.model.n_heads, c.model.n_kv_heads, c.model.head_dim = 2, 1, 16
    c.model.max_seq_len = 2304        # longest prompt: 1,895 + 202 instruction characters
    c.rollout.max_new_tokens = 16
    c.rollout.slots, c.eval.slots = 4, 4
    c.rollout.env_workers = 4
    c.rollout.max_prefill_length = 2176
    c.task.max_turns = 4
    c.task.n_eval = 4
    c.train.batch_size, c.train.num_steps = 4, 2
    c.eval.every_steps, c.checkpoint.every_steps = 0, 0
    c.train.policy_lr, c.train.critic_lr = 1e-4, 1e-4
    c.allow_random_init = True        # only the smoke variant may run without a checkpoint
    c.rollout.kv_bucket = c.model.max_seq_len  # fewest compiles (a wiring check): one decode
    c.rollout.prefill_rows = "all"             # program per shape, one prefill per length
  elif variant:
    raise ValueError(f"unknown variant {variant!r} of configs/aime.py; use '' or 'smoke'.")
  return c

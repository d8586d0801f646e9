"""SAO with a real pretrained LM on 2 CPU cores: SmolLM2-135M-Instruct on small-number sums.

`python -m sao_jax.main --config=configs/smollm2_arith.py`

The packaged SmolLM2-135M-Instruct GGUF (`c.model.gguf = "smollm2"`, as in
`configs/gsm8k_smollm2.py`) answers "What is 13 + 14?" (operands 1-30, + and -,
`sao_jax/envs/chat_arith.py`) through its ChatML template; the reward is math-verify on the last
`\\boxed{}`. Held-out: 200 problems whose operand pairs never occur in training (either order).
Short prompts (<= 59 tokens) and responses (<= 32 tokens) keep a policy step cheap; the lr is
far above the paper's 1e-6 (which is for a 30B model). `:smoke` = two SAO steps, 4 eval
problems (a wiring check with the real model, not seconds: it compiles the 135M train step).
The plot: `python benchmarks/plot_smollm2_arith.py`.
`:compare` = the setting of `experiments/real_lm.py` (SAO vs GRPO+DIS; the answer starts with the
problem, "13 + 14 =", so the format is already right and RL must improve the arithmetic).
`:accelerator` = the same run sized for one GPU / TPU host (batch 128, 60 steps); its speed and
memory on one H200 (random weights of this shape): benchmarks/RESULTS.md section 8.
"""

import ml_collections

from sao_jax import configs


def get_config(variant: str = "") -> ml_collections.ConfigDict:
  c = configs.load("gsm8k_smollm2")
  c.run_dir = "runs/smollm2_arith"
  c.task.name = "chat_arith"
  c.task.max_operand = 30                  # a + b, a - b with 1 <= b (<= a) <= 30
  c.task.n_train = 1000                    # of the ~1025 train-split problems
  c.task.n_eval = 200                      # held-out (of ~340), greedy, before and after
  c.task.train_file, c.task.eval_file = "", ""
  c.task.system_prompt = ""                # "" = chat_arith.SYSTEM (one worked example)

  c.model.max_seq_len = 96                 # prompt (<= 59 tokens) + response (<= 32)
  c.rollout.temperature = 0.5             # at 1.0 the base model's samples score 0/96; at 0.5 ~11%
  c.rollout.max_new_tokens = 32
  c.rollout.max_prefill_length = 64
  c.rollout.slots = 32
  c.rollout.queue_size = 64

  # measured (benchmarks/smollm2_step_memory.py, RESULTS section 5b): one whole SAO step on all
  # 16 rows at once grows the process by about 4.2 GB (2.2-4.8 GB in 4 micro-batches), so no
  # micro-batching is needed for memory on a 24 GB host; kept because the step is no slower
  # with it (45-47 s vs 50-53 s whole, on one core)
  c.mesh.tokens_per_device = 384           # micro-batches of 4 rows of 96 tokens
  c.train.batch_size = 16
  # at this lr a 40-step run peaked at step 10 (58% on 100 held-out), then collapsed (8% at 20)
  c.train.num_steps = 12                   # policy steps (~65 s each on 2 loaded cores)
  c.train.policy_lr = 3e-5
  c.train.critic_lr = 1e-4
  c.train.critic_lr_warmup_steps = 5
  c.train.critic_warmup_steps = 0          # the measured run had no value pre-training (each
                                           # critic-only step costs ~40 s of 135M training here)
  c.eval.slots = 50
  c.eval.every_steps = 4
  c.eval.periodic_problems = 50
  # the responses script reads the end-of-run checkpoint (with every_steps=0 none is written)
  c.checkpoint.every_steps = 12            # = num_steps: one checkpoint, at the end
  c.log.tensorboard = False

  if variant == "smoke":
    c.run_dir = "runs/smollm2_arith_smoke"
    c.task.n_train, c.task.n_eval = 16, 4
    c.rollout.max_new_tokens = 8
    c.rollout.slots, c.eval.slots = 4, 4
    c.train.batch_size, c.train.num_steps = 4, 2
    c.mesh.tokens_per_device = 0
    c.eval.every_steps, c.checkpoint.every_steps = 0, 0
    c.rollout.kv_bucket = c.model.max_seq_len  # fewest compiles (a wiring check): one decode
    c.rollout.prefill_rows = "all"             # program per shape, one prefill per length
  elif variant == "compare":
    # Issue 30 item 6 (experiments/real_lm.py; fixed before its runs): a setting where the format
    # is already right and RL must improve the arithmetic. The assistant's turn starts with the
    # problem, "13 + 14 =" (task.answer_prefix), and the model writes the rest of the one-line
    # template: base model greedy on the 200 held-out 34.5% right, 95% formatted (2026-12-07,
    # /tmp one-off; without the prefix 19% / 44%; with "... = \boxed{" 2%).
    c.run_dir = "runs/smollm2_arith_compare"
    c.task.answer_prefix = "{expr} ="
    c.rollout.max_prefill_length = 80     # prompts up to 70 tokens with the prefix
    c.rollout.max_new_tokens = 20         # " 27. The answer is \boxed{27}." is ~14 tokens
    c.train.num_steps = 60
    c.train.policy_lr = 1e-5              # a third of the lr whose 40-step run collapsed
    c.train.critic_warmup_steps = 5       # value pre-training (SAO's pre-trained critic)
    c.eval.every_steps, c.eval.periodic_problems = 10, 200
    c.checkpoint.every_steps = 0
  elif variant == "accelerator":
    # One GPU / TPU host (issue 17 item 5). Run on one H200 with random weights of this shape
    # only (benchmarks/RESULTS.md section 8; learning not measured). Full batches (no
    # micro-batching),
    # the paper's 32 x 4 = 128 trajectories per step, value pre-training on, a small KL to the
    # start (the CPU run drifted after step 10 without one), eval on all 200 every 5 steps.
    c.run_dir = "runs/smollm2_arith_accelerator"
    c.mesh.tokens_per_device = 0
    c.train.batch_size, c.train.num_steps = 128, 60
    c.rollout.slots, c.eval.slots, c.rollout.queue_size = 128, 200, 256
    c.train.policy_lr, c.train.critic_lr = 1e-5, 5e-5
    c.train.critic_warmup_steps = 10
    c.train.kl_coef = 1e-3
    c.eval.every_steps, c.eval.periodic_problems = 5, 200
    c.checkpoint.every_steps = 20
  elif variant:
    raise ValueError(f"unknown variant {variant!r} of configs/smollm2_arith.py; use '', 'smoke', "
                     "'compare' or 'accelerator'.")
  return c

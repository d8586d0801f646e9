"""SAO on the CPU-sized tool-integrated arithmetic task (the main job's default).

`python -m sao_jax.main --config=configs/arith_tool.py`; override any field on the command line,
e.g. `--config.train.num_steps=10`. Variant `configs/arith_tool.py:smoke` runs a few steps only.
"""

import ml_collections


def get_config(variant: str = "") -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0                      # one seed for model init, data order, sampling
  c.run_dir = "runs/arith_tool"   # metrics.jsonl/.csv, results.csv, tb/, checkpoints/
  c.allow_random_init = True      # start from a random model (+ SFT) when no checkpoint is given

  c.task = ml_collections.ConfigDict()
  c.task.name = "arith_tool"      # tasks.make_task: "arith_tool" or "math"
  c.task.n_train = 4000           # training problems (cycled in a fixed shuffled order)
  c.task.n_eval = 200             # held-out problems (disjoint from train), greedy eval
  c.task.prompt_pool = 0          # RL cycles over the first N training problems (0 = all); the
                                  # SFT demos still come from all (sft.num_demos)
  c.task.max_turns = 3            # policy turns per trajectory (tool call, answer, ...)
  c.task.tool_latency_median_s = 0.0  # median s each tool call sleeps (lognormal; 0 = off)
                                  # the long-tailed setting: seeded per trajectory
                                  # (envs/arith_tool.py:tool_latency); greedy eval is unaffected
  c.task.tool_latency_sigma = 1.0 # log-std of the tool latency (p99 = median * e^(2.33 sigma))
  c.task.train_file = ""          # task "math": JSONL training prompts (packaged name or a path)
  c.task.eval_file = ""           # task "math": held-out JSONL ("" = the first n_eval train prompts)
  c.task.system_prompt = ""       # task "math" with a chat template: system message ("" = default)

  c.model = ml_collections.ConfigDict()
  c.model.checkpoint_dir = ""     # policy to start from: a sao_jax orbax run checkpoint, or a
                                  # Hugging Face folder (config.json + safetensors + tokenizer.json;
                                  # its shapes and tokenizer then replace the fields below)
  c.model.gguf = ""               # llama.cpp GGUF file to start from ("smollm2" = packaged SmolLM2)
  c.model.param_dtype = "float32" # stored / served parameter dtype (checkpoint load, random
                                  # init, published weights); the learner trains a float32 master
  c.model.d_model = 128           # residual width
  c.model.n_layers = 2            # transformer blocks
  c.model.n_heads = 4             # query heads
  c.model.n_kv_heads = 2          # key/value heads (GQA)
  c.model.head_dim = 32           # per-head width
  c.model.d_ff = 384              # SwiGLU hidden width
  c.model.rope_theta = 10000.0    # RoPE base
  c.model.max_seq_len = 64        # prompt + response tokens
  c.model.dtype = "float32"       # compute dtype
  c.model.remat = "none"          # training forward's block remat: "none" (keep activations),
                                  # "block" (recompute each block in the backward: least memory),
                                  # "dots_saveable" (keep the projections' outputs only)
  c.model.scan_layers = False     # training forward: one lax.scan over identical layers (compile
                                  # time flat in depth; use with remat); params stay per layer

  c.sft = ml_collections.ConfigDict()
  c.sft.steps = 1000              # supervised warm-up steps on demonstrations (0 = none)
  c.sft.batch_size = 64           # demonstrations per SFT step
  c.sft.lr = 3e-3                 # SFT peak learning rate (Adam, linear warm-up)
  c.sft.num_demos = 4000          # demonstrations built from the first train problems
  c.sft.p_tool = 0.3              # fraction of demos that call the tool (the rest guess)
  c.sft.p_guess_correct = 0.1     # fraction of guesses that happen to be right
  c.sft.cache_dir = ""            # reuse the warm start of an identical SFT (config+task+seed) from
                                  # here (safetensors); "" = always train it

  c.rollout = ml_collections.ConfigDict()
  c.rollout.slots = 32            # decode slots of the engine (continuous batching)
  c.rollout.temperature = 1.0     # sampling temperature (log-probs recorded at this temperature)
  c.rollout.max_new_tokens = 24   # per-turn cap on sampled tokens
  c.rollout.max_prefill_length = 64  # longest prompt / observation chunk
  c.rollout.decode_steps = 4      # tokens per slot per engine call; weights change between calls
                                  # (main job tokens/s vs 1 step per call: 4 -> 0.98-1.31x, 8 -> ~0.55x)
  c.rollout.queue_size = 64       # bounded trajectory queue (backpressure)
  c.rollout.kv_on_update = "keep" # weight update mid-rollout: "keep" stale KV or "recompute"
  c.rollout.staleness_policy = "none"  # "none", "admission", "drop" or "admission+drop"
  c.rollout.max_staleness = 4     # eta: bound on policy_version lag under a staleness policy
  c.rollout.env_timeout_s = 30.0  # env.step wall-clock limit; over it the trajectory is failed
  c.rollout.env_workers = -1      # env.step threads (-1 auto: slots if tool latency, else 0)
                                  # N > 0: a slow tool call stalls only its own slot while the
                                  # others decode; 0 = inline env.step (blocks every slot)
  c.rollout.lockstep = False      # True: deterministic synchronous rollout (bit-exact resume)
  c.rollout.lockstep_delay = 0    # lockstep: sample step n's batch with the weights of n-1-d, so
                                  # every token's staleness is exactly d (matched across arms)
  c.rollout.backend = "thread"    # TrajectorySource: "thread" (in this process) or "ray" (actors)
  c.rollout.num_workers = 1       # rollout workers (engines); > 1 needs backend "ray"
  c.rollout.ray_address = ""      # backend "ray": cluster address ("" = start a local Ray)
  c.rollout.ray_num_cpus = 1.0    # backend "ray": CPUs reserved per rollout actor
  c.rollout.ray_num_gpus = 0.0    # backend "ray": GPUs per rollout actor (e.g. 1 on a GPU node)
  c.rollout.ray_resources = ml_collections.ConfigDict()  # other Ray resources per actor ({"TPU": 4})
  c.rollout.ray_max_restarts = 4  # backend "ray": restarts of a dead actor (-1 = unlimited)
  c.rollout.ray_max_outstanding = 0  # backend "ray": prompts one actor holds (0 = 2 x slots)
  c.rollout.weight_sync = "auto"  # backend "ray": "transfer" (jax.experimental.transfer),
                                  # "object_store" (ray.put) or "auto" (object store on CPU)

  c.train = ml_collections.ConfigDict()
  c.train.mode = "sao"            # sao, vapo, grpo_async or grpo_sync (sao_jax/train/modes.py)
  c.train.objective = "auto"      # auto (mode default: sao->dis, others->ppo_clip), dis,
                                  # ppo_clip, tis, icepop, reinforce (sao_jax/algo/objectives.py)
  c.train.advantage_estimator = "auto"  # auto (sao/vapo->skip_obs_gae, grpo->grpo), skip_obs_gae,
                                  # naive_gae, step_gae_mean, step_gae_last, grpo, grpo_no_std,
                                  # running_mean_prompt, running_mean_global
  c.train.group_size = 8          # G rollouts per prompt in the grpo modes (batch_size % G == 0)
  c.train.num_steps = 100         # policy steps (policy_version increases by one per step)
  c.train.batch_size = 32         # trajectories per policy step (paper: 128), one per prompt
  c.train.policy_lr = 3e-4        # policy learning rate (paper: 1e-6 for a 30B model)
  c.train.critic_lr = 1e-3        # critic learning rate (paper: 5e-6)
  c.train.critic_lr_warmup_steps = 10  # critic linear lr warm-up (paper: 10)
  c.train.critic_updates_per_step = 2  # K critic updates per policy update (paper: 2)
  c.train.critic_warmup_steps = 10  # value pre-training: critic-only steps (K updates each) on
                                  # rollouts of the starting policy before RL, as the paper
                                  # pre-trains its value model; skipped without a critic
  c.train.policy_minibatches = 1  # M policy updates per batch, one per mini-batch, PPO's pi_old =
                                  # the policy at the batch's start (1 = SAO's one update)
  c.train.freeze_critic_attention = True  # critic trains only MLP, norms, embeddings, value head
  # regexes over critic param paths frozen when freeze_critic_attention (e.g. add r"/mlp/router/",
  # r"backbone/embed/", r"_norm/" to freeze the MoE router, embeddings, norms too)
  c.train.critic_frozen_patterns = (r"/attn/",)  # critic params frozen when freeze_critic_attention
  c.train.eps_low = 0.3           # DIS band: keep tokens with 1-eps_low < ratio < 1+eps_high
  c.train.eps_high = 5.0          # DIS band upper half-width (paper: 5.0 math/tool, 3.0 coding)
  c.train.gamma = 1.0             # discount
  c.train.lam_policy = "adaptive" # "adaptive" = 1 - 1/(lam_alpha * l), or a float
  c.train.lam_alpha = 1.5         # alpha of the length-adaptive lambda
  c.train.lam_critic = 1.0        # GAE lambda of the critic's returns (paper: 1.0, Monte Carlo)
  c.train.value_clip_eps = 0.0    # PPO-style value clipping half-width (0 = off; algo/value_loss)
  c.train.max_grad_norm = 1.0     # global-norm gradient clipping
  c.train.adam_eps = 1e-8         # Adam's denominator epsilon, policy and critic (optax default)
  c.train.critic_b1 = 0.9         # the critic's Adam b1 (momentum; optax default 0.9)
  c.train.value_bounds = ()       # (lo, hi): clip the critic's values to the reward range before
                                  # GAE, e.g. (0.0, 1.0); () = off (ours, not the paper's)
  c.train.center_advantages = False  # subtract the batch mean advantage (ours; off = the paper)
  c.train.ppo_eps_low = 0.2       # PPO-family clip band 1-ppo_eps_low .. 1+ppo_eps_high (clip-higher)
  c.train.ppo_eps_high = 0.28      # upper PPO clip (DAPO clip-higher: 0.28 > ppo_eps_low)
  c.train.dual_clip = 0.0         # PPO dual-clip constant c > 1 for A < 0 (0 = off)
  c.train.tis_cap = 2.0           # objective=tis: weight min(pi_old / pi_rollout, tis_cap)
  c.train.icepop_low = 0.5        # objective=icepop: keep tokens with icepop_low <= pi_old/pi_rollout
  c.train.icepop_high = 5.0       #   <= icepop_high
  c.train.aggregation = "token_mean"  # token_mean, seq_mean or sum_norm (loss over action tokens)
  c.train.loss_norm_constant = 0  # sum_norm divisor (e.g. max response tokens); 0 = unset
  c.train.kl_coef = 0.0           # k3 KL(pi || pi_ref) penalty, ref = the warm-started policy
  c.train.entropy_coef = 0.0      # entropy bonus coefficient
  c.train.logprob_chunk = 512     # tokens per device per chunk of the LM head's log-probs
                                  # (action tokens only; 0 = full [B, T, V] logits)
  c.train.baseline_window = 8     # running_mean_prompt: last N rewards of the same prompt (paper 8)
  c.train.global_baseline_window = 128  # running_mean_global: last N rewards overall (paper 128)
  c.train.bootstrap_truncated = False  # truncated trajectories bootstrap from V(last state), not 0
  c.train.max_consecutive_nonfinite = 3  # NaN/inf steps are skipped; stop after this many in a row

  c.eval = ml_collections.ConfigDict()
  c.eval.slots = 64               # decode slots for greedy evaluation
  c.eval.every_steps = 20         # periodic eval (0 = only before/after)
  c.eval.periodic_problems = 100  # problems in the periodic eval (first of the held-out set)

  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.every_steps = 50   # orbax checkpoint period (0 = never); always one at the end
  c.checkpoint.max_to_keep = 2    # newest complete checkpoints kept
  c.checkpoint.resume = True      # continue from the latest complete checkpoint in run_dir

  c.mesh = ml_collections.ConfigDict()
  c.mesh.shape = ""               # e.g. "data=1,fsdp=-1" (-1 = remaining devices); "" = one device
  c.mesh.tokens_per_device = 0    # padded tokens per device per micro-batch (0 = no accumulation)

  c.distributed = ml_collections.ConfigDict()  # jax.distributed (or env JAX_COORDINATOR_ADDRESS...)
  c.distributed.coordinator_address = ""  # "host:port" of process 0; "" = single process
  c.distributed.num_processes = -1        # processes in the job (-1 = from the environment)
  c.distributed.process_id = -1           # this process (-1 = from the environment)
  c.distributed.cpu_collectives = "gloo"  # CPU cross-process collectives

  c.log = ml_collections.ConfigDict()
  c.log.tensorboard = True        # TensorBoard event files under run_dir/tb
  c.log.progress = "auto"         # "auto" (bar on a terminal, plain lines otherwise), "bar", "lines", "off"
  c.log.wandb_project = ""        # Weights & Biases project name ("" = off; needs `pip install wandb`)

  if variant == "smoke":
    c.task.n_train, c.task.n_eval = 64, 16
    c.sft.steps, c.sft.num_demos = 20, 64
    c.rollout.slots, c.eval.slots = 8, 16
    c.train.num_steps, c.train.batch_size = 3, 8
    c.train.critic_warmup_steps = 2
    c.eval.every_steps, c.checkpoint.every_steps = 2, 2
    c.run_dir = "runs/arith_tool_smoke"
  elif variant:
    raise ValueError(f"unknown variant {variant!r} of configs/arith_tool.py; use '' or 'smoke'.")
  return c

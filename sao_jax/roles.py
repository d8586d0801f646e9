"""Typed role configs: every config field's default, doc and allowed values in one place.

The ml_collections config files (``configs/*.py``) stay the user's interface: each starts from
``default_config()`` (the ConfigDict of these defaults) and changes what it needs. The top of a
run converts the ConfigDict once with ``from_config`` into a frozen ``Run``; below it modules
take the typed roles (``Run.task``, ``Run.train``, ...), not the ConfigDict.

A field is declared with ``_f(default, doc, check=..., choices=...)``:
  * ``check``: a range, one of ``">=0"``, ``">0"``, ``">=1"``, ``">=-1"``, ``"[0,1]"``,
    ``"[0,1)"`` (``check_problem`` turns it into "must be ..."; an int is accepted for a float);
  * ``choices``: the allowed values, a tuple or a zero-argument function returning one (read from
    the registry that consumes the field, e.g. ``sao_jax.algo.OBJECTIVES``, at check time);
  * ``types``: the accepted Python types when the default's type is not enough.
Validation (``train/validation.py``) and ``docs/config.md`` (``sao_jax/docs_gen.py``) are derived
from these fields; cross-field rules stay explicit functions in ``train/validation.py``.
Adding a config field is one line here (see docs/extending.md).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from typing import Any, Callable, Optional

import ml_collections


def _f(default, doc: str, *, check: Optional[str] = None, choices=None, types=None):
  """A role field: ``default`` (a dict default is copied per instance), ``doc`` (one line of
  docs/config.md), ``check`` (range spec), ``choices`` (tuple or function), ``types``."""
  md = {"doc": doc, "check": check, "choices": choices, "types": types}
  if isinstance(default, dict):
    return dataclasses.field(default_factory=lambda: dict(default), metadata=md)
  return dataclasses.field(default=default, metadata=md)


field = _f  # the public name (docs/extending.md declares a field with it)


def _modes():
  from sao_jax.train.modes import MODES  # pylint: disable=import-outside-toplevel
  return tuple(MODES)


def _objectives():
  from sao_jax import algo  # pylint: disable=import-outside-toplevel
  return ("auto",) + tuple(algo.OBJECTIVES)


def _estimators():
  from sao_jax import algo  # pylint: disable=import-outside-toplevel
  return ("auto",) + tuple(algo.ESTIMATORS)


def _aggregations():
  from sao_jax.algo.objectives import AGGREGATIONS  # pylint: disable=import-outside-toplevel
  return tuple(AGGREGATIONS)


def _staleness_policies():
  from sao_jax.rollout.staleness import POLICIES  # pylint: disable=import-outside-toplevel
  return tuple(POLICIES)


def _remat():
  from sao_jax.models.config import REMAT_POLICIES  # pylint: disable=import-outside-toplevel
  return tuple(REMAT_POLICIES)


def _progress():
  from sao_jax.train.progress import MODES  # pylint: disable=import-outside-toplevel
  return tuple(MODES)


def _tasks():
  from sao_jax.envs.registry import TASKS  # pylint: disable=import-outside-toplevel
  return tuple(TASKS)


_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class Task:
  """The task: environment, problems, demonstrations (sao_jax/envs/registry.py)."""
  name: str = _f("arith_tool", "the task (sao_jax/envs/registry.py:TASKS)", choices=_tasks)
  n_train: int = _f(4000, "training problems (cycled in a fixed shuffled order)", check=">=1")
  n_eval: int = _f(200, "held-out problems (disjoint from train), greedy eval", check=">=1")
  prompt_pool: int = _f(0, "RL cycles over the first N training problems (0 = all); the SFT "
                        "demos still come from all (sft.num_demos)", check=">=0")
  max_turns: int = _f(3, "policy turns per trajectory (tool call, answer, ...)", check=">=1")
  tool_latency_median_s: float = _f(
      0.0, "median s each tool call sleeps (lognormal; 0 = off): the long-tailed setting, seeded "
      "per trajectory (envs/arith_tool.py:tool_latency); greedy eval is unaffected", check=">=0")
  tool_latency_sigma: float = _f(1.0, "log-std of the tool latency (p99 = median * "
                                 "e^(2.33 sigma))", check=">=0")
  train_file: str = _f("", "tasks math / tir_math: JSONL training prompts (packaged name, a "
                       "path, or for tir_math a comma-separated list or 'paper_mix')")
  eval_file: str = _f("", "tasks math / tir_math: held-out JSONL ('' = math: the training "
                      "prompts; tir_math: aime25.jsonl)")
  system_prompt: str = _f("", "chat tasks: system message ('' = the task's default)")
  chain_lengths: tuple = _f((3, 4, 5), "chain_tool: calculator calls a problem needs")
  chain_weights: tuple = _f((0.2, 0.5, 0.3), "chain_tool: the probabilities of chain_lengths")
  obs_pad: int = _f(0, "chain_tool: noise characters before each tool result (the long-"
                    "observation variant, configs/chain_tool.py:long_obs); 0 = plain", check=">=0")
  swe_generated: int = _f(0, "swe_lite: procedurally generated modules added to the 62 "
                          "hand-written ones (envs/swe_lite_gen.py)", check=">=0")
  swe_kinds: tuple = _f(("comparison", "operator", "off_by_one", "missing_edge_case"),
                        "swe_lite: the mutation kinds instances are drawn from (a curriculum)")
  tool_cpu_s: int = _f(5, "tir_math: sandbox CPU seconds per program run", check=">=1")
  tool_wall_s: float = _f(10.0, "tir_math: sandbox wall-clock seconds per program run",
                          check=">0")
  tool_memory_mb: int = _f(1024, "tir_math: sandbox address-space limit per program run (MiB)",
                           check=">=1")
  tool_output_chars: int = _f(1024, "tir_math: observation cut (characters)", check=">=1")
  switch_every: int = _f(20, "style_switch: policy steps per preferred-style phase", check=">=1")
  style_base: str = _f("arith_tool", "style_switch: the wrapped task",
                       choices=("arith_tool", "chain_tool"))
  max_operand: int = _f(30, "chat_arith: largest operand", check=">=1")
  answer_prefix: str = _f("", "chat_arith: text that starts the assistant's turn, graded as "
                          "the response's start; {expr} = the problem ('{expr} =': 13 + 14 =)")


@dataclasses.dataclass(frozen=True)
class Model:
  """The policy (and critic backbone) model."""
  checkpoint_dir: str = _f("", "policy to start from: a sao_jax orbax run checkpoint, or a "
                           "Hugging Face folder (config.json + safetensors + tokenizer.json; its "
                           "shapes and tokenizer then replace the fields below) or hub id "
                           "('Qwen/Qwen3-0.6B', read from the hub cache, offline too)")
  gguf: str = _f("", "llama.cpp GGUF file to start from ('smollm2' = packaged SmolLM2)")
  param_dtype: str = _f("float32", "stored / served parameter dtype (checkpoint load, random "
                        "init, published weights); the learner trains a float32 master",
                        choices=_DTYPES)
  d_model: int = _f(128, "residual width", check=">=1")
  n_layers: int = _f(2, "transformer blocks", check=">=1")
  n_heads: int = _f(4, "query heads", check=">=1")
  n_kv_heads: int = _f(2, "key/value heads (GQA)", check=">=1")
  head_dim: int = _f(32, "per-head width (even: RoPE rotates pairs)", check=">=1")
  d_ff: int = _f(384, "SwiGLU hidden width", check=">=1")
  rope_theta: float = _f(10000.0, "RoPE base", check=">0")
  max_seq_len: int = _f(64, "prompt + response tokens", check=">=1")
  dtype: str = _f("float32", "compute dtype", choices=_DTYPES)
  remat: str = _f("none", "training forward's block remat: 'none' (keep activations), 'block' "
                  "(recompute each block in the backward: least memory), 'dots_saveable' (keep "
                  "the projections' outputs only)", choices=_remat)
  scan_layers: bool = _f(False, "training forward: one lax.scan over identical layers (compile "
                         "time flat in depth; use with remat); params stay per layer")


@dataclasses.dataclass(frozen=True)
class SFT:
  """The supervised warm-up on demonstrations."""
  steps: int = _f(1000, "supervised warm-up steps on demonstrations (0 = none)", check=">=0")
  batch_size: int = _f(64, "demonstrations per SFT step", check=">=1")
  lr: float = _f(3e-3, "SFT peak learning rate (Adam, linear warm-up)", check=">0")
  num_demos: int = _f(4000, "demonstrations built from the first train problems", check=">=0")
  p_tool: float = _f(0.3, "fraction of demos that call the tool (the rest guess)", check="[0,1]")
  p_guess_correct: float = _f(0.1, "fraction of guesses that happen to be right", check="[0,1]")
  cache_dir: str = _f("", "reuse the warm start of an identical SFT (config+task+seed) from here "
                      "(safetensors); '' = always train it")
  reliable_calls: int = _f(3, "chain_tool: calls every demonstration makes (if the chain has "
                           "them)", check=">=0")


@dataclasses.dataclass(frozen=True)
class Rollout:
  """Rollout: engine slots, sampling, staleness, backend and placement."""
  slots: int = _f(32, "decode slots of the engine (continuous batching)", check=">=1")
  temperature: float = _f(1.0, "sampling temperature (log-probs recorded at this temperature)",
                          check=">0")
  max_new_tokens: int = _f(24, "per-turn cap on sampled tokens", check=">=1")
  max_prefill_length: int = _f(64, "longest prompt / observation chunk", check=">=1")
  kv_bucket: int = _f(32, "smallest live-length bucket of a decode step (buckets double up to "
                      "model.max_seq_len; one compiled decode program each: larger = fewer "
                      "compiles, more attention work per token)", check=">=1")
  prefill_rows: str = _f("pow2", "rows of a batched prefill: 'pow2' pads to the next power of "
                         "two (one compile per row count and chunk length) or 'all' to every "
                         "slot (one compile per chunk length, more padding)",
                         choices=("pow2", "all"))
  decode_steps: int = _f(4, "tokens per slot per engine call; weights change between calls",
                         check=">=1")
  overlap_host: bool = _f(False, "dispatch the next decode call before the host reads the "
                          "previous one's tokens (device decodes while Python routes tokens; "
                          "SAOEngine only; rollout/worker.py module doc)")
  queue_size: int = _f(64, "bounded trajectory queue (backpressure)", check=">=1")
  kv_on_update: str = _f("keep", "weight update mid-rollout: 'keep' stale KV or 'recompute'",
                         choices=("keep", "recompute"))
  staleness_policy: str = _f("none", "'none', 'admission', 'drop' or 'admission+drop'",
                             choices=_staleness_policies)
  max_staleness: int = _f(4, "eta: bound on policy_version lag under a staleness policy")
  env_timeout_s: float = _f(30.0, "env.step wall-clock limit; over it the trajectory is failed",
                            check=">0")
  env_workers: int = _f(-1, "env.step threads (-1 auto: slots if tool latency or tir_math, else "
                        "0); N > 0: a slow tool call stalls only its own slot while the others "
                        "decode; 0 = inline env.step (blocks every slot)", check=">=-1")
  lockstep: bool = _f(False, "True: deterministic synchronous rollout (bit-exact resume)")
  lockstep_delay: int = _f(0, "lockstep: sample step n's batch with the weights of n-1-d, so "
                           "every token's staleness is exactly d (matched across arms)",
                           check=">=0")
  devices: int = _f(0, "backend 'thread': local devices the rollout engine gets (the first N; "
                    "the learner's mesh.shape lays out the rest); 0 = share device 0 with the "
                    "learner", check=">=0")
  mesh: str = _f("data=-1", "the rollout devices' mesh: axes data (slots), tensor, expert, e.g. "
                 "'data=2,tensor=2' (-1 = the rest of rollout.devices); tensor must divide the "
                 "model's n_kv_heads; expert only for MoE models")
  backend: str = _f("thread", "TrajectorySource: 'thread' (in this process) or 'ray' (actors)",
                    choices=("thread", "ray"))
  num_workers: int = _f(1, "rollout workers (engines); > 1 needs backend 'ray'", check=">=1")
  ray_address: str = _f("", "backend 'ray': cluster address ('' = start a local Ray)")
  ray_num_cpus: float = _f(1.0, "backend 'ray': CPUs reserved per rollout actor", check=">=0")
  ray_num_gpus: float = _f(0.0, "backend 'ray': GPUs per rollout actor (e.g. 1 on a GPU node)",
                           check=">=0")
  ray_resources: dict = _f({}, "backend 'ray': other Ray resources per actor ({'TPU': 4})")
  ray_max_restarts: int = _f(4, "backend 'ray': restarts of a dead actor (-1 = unlimited)",
                             check=">=-1")
  ray_max_outstanding: int = _f(0, "backend 'ray': prompts one actor holds (0 = 2 x slots)",
                                check=">=0")
  weight_sync: str = _f("auto", "backend 'ray': 'transfer' (jax.experimental.transfer), "
                        "'object_store' (ray.put) or 'auto' (object store on CPU)",
                        choices=("auto", "transfer", "object_store"))
  weight_bucket_mb: float = _f(512.0, "backend 'ray': weights move in buckets of this many MB "
                               "(an actor places one while the next moves; 0 = whole tree)",
                               check=">=0")


@dataclasses.dataclass(frozen=True)
class Train:
  """The learner: mode, objective, estimator, optimiser and loss settings."""
  mode: str = _f("sao", "sao, vapo, grpo_async or grpo_sync (sao_jax/train/modes.py)",
                 choices=_modes)
  objective: str = _f("auto", "auto (mode default: sao->dis, others->ppo_clip) or a name of "
                      "sao_jax/algo/objectives.py:OBJECTIVES", choices=_objectives)
  advantage_estimator: str = _f("auto", "auto (sao/vapo->skip_obs_gae, grpo->grpo) or a name of "
                                "sao_jax/algo/estimators.py:ESTIMATORS", choices=_estimators)
  group_size: int = _f(8, "G rollouts per prompt in the grpo modes (batch_size % G == 0)",
                       check=">=1")
  num_steps: int = _f(100, "policy steps (policy_version increases by one per step)",
                      check=">=1")
  batch_size: int = _f(32, "trajectories per policy step (paper: 128), one per prompt",
                       check=">=1")
  policy_lr: float = _f(3e-4, "policy learning rate (paper: 1e-6 for a 30B model)", check=">0")
  critic_lr: float = _f(1e-3, "critic learning rate (paper: 5e-6)", check=">0")
  critic_lr_warmup_steps: int = _f(10, "critic linear lr warm-up (paper: 10)", check=">=0")
  critic_updates_per_step: int = _f(2, "K critic updates per policy update (paper: 2)",
                                    check=">=1")
  critic_warmup_steps: int = _f(10, "value pre-training: critic-only steps (K updates each) on "
                                "rollouts of the starting policy before RL; skipped without a "
                                "critic", check=">=0")
  policy_minibatches: int = _f(1, "M policy updates per batch, one per mini-batch, PPO's pi_old "
                               "= the policy at the batch's start (1 = SAO's one update)",
                               check=">=1")
  freeze_critic_attention: bool = _f(True, "critic trains only MLP, norms, embeddings, value "
                                     "head")
  critic_frozen_patterns: tuple = _f(
      (r"/attn/",), "regexes over critic param paths frozen when freeze_critic_attention (e.g. "
      "add r'/mlp/router/', r'backbone/embed/', r'_norm/')")
  eps_low: float = _f(0.3, "DIS band: keep tokens with 1-eps_low < ratio < 1+eps_high",
                      check="[0,1)")
  eps_high: float = _f(5.0, "DIS band upper half-width (paper: 5.0 math/tool, 3.0 coding)",
                       check=">0")
  gamma: float = _f(1.0, "discount", check="[0,1]")
  lam_policy: Any = _f("adaptive", "'adaptive' = 1 - 1/(lam_alpha * l), or a number in [0, 1]",
                       types=(str, int, float))
  lam_alpha: float = _f(1.5, "alpha of the length-adaptive lambda", check=">0")
  lam_critic: float = _f(1.0, "GAE lambda of the critic's returns (paper: 1.0, Monte Carlo)",
                         check="[0,1]")
  value_clip_eps: float = _f(0.0, "PPO-style value clipping half-width (0 = off; "
                             "algo/value_loss)", check=">=0")
  max_grad_norm: float = _f(1.0, "global-norm gradient clipping", check=">0")
  adam_eps: float = _f(1e-8, "Adam's denominator epsilon, policy and critic (optax default)",
                       check=">0")
  critic_b1: float = _f(0.9, "the critic's Adam b1 (momentum; optax default 0.9)",
                        check="[0,1)")
  value_bounds: tuple = _f((), "(lo, hi): clip the critic's values to the reward range before "
                           "GAE, e.g. (0.0, 1.0); () = off (ours, not the paper's)")
  center_advantages: bool = _f(False, "subtract the batch mean advantage (ours; off = the paper)")
  ppo_eps_low: float = _f(0.2, "PPO-family clip band 1-ppo_eps_low .. 1+ppo_eps_high",
                          check="[0,1)")
  ppo_eps_high: float = _f(0.28, "upper PPO clip (DAPO clip-higher: 0.28 > ppo_eps_low)",
                           check=">0")
  dual_clip: float = _f(0.0, "PPO dual-clip constant c > 1 for A < 0 (0 = off)")
  tis_cap: float = _f(2.0, "objective=tis: weight min(pi_old / pi_rollout, tis_cap)", check=">0")
  icepop_low: float = _f(0.5, "objective=icepop: keep tokens with icepop_low <= "
                         "pi_old/pi_rollout", check="[0,1)")
  icepop_high: float = _f(5.0, "objective=icepop: ... <= icepop_high")
  aggregation: str = _f("token_mean", "token_mean, seq_mean or sum_norm (loss over action "
                        "tokens)", choices=_aggregations)
  loss_norm_constant: int = _f(0, "sum_norm divisor (e.g. max response tokens); 0 = unset",
                               check=">=0")
  kl_coef: float = _f(0.0, "k3 KL(pi || pi_ref) penalty, ref = the warm-started policy",
                      check=">=0")
  entropy_coef: float = _f(0.0, "entropy bonus coefficient", check=">=0")
  logprob_chunk: int = _f(512, "tokens per device per chunk of the LM head's log-probs (action "
                          "tokens only; 0 = full [B, T, V] logits)", check=">=0")
  baseline_window: int = _f(8, "running_mean_prompt: last N rewards of the same prompt (paper "
                            "8)", check=">=1")
  global_baseline_window: int = _f(128, "running_mean_global: last N rewards overall (paper 128)",
                                   check=">=1")
  bootstrap_truncated: bool = _f(False, "truncated trajectories bootstrap from V(last state), "
                                 "not 0")
  max_consecutive_nonfinite: int = _f(3, "NaN/inf steps are skipped; stop after this many in a "
                                      "row", check=">=1")


@dataclasses.dataclass(frozen=True)
class Eval:
  """Greedy evaluation on the held-out problems."""
  slots: int = _f(64, "decode slots for greedy evaluation", check=">=1")
  every_steps: int = _f(20, "periodic eval (0 = only before/after)", check=">=0")
  periodic_problems: int = _f(100, "problems in the periodic eval (first of the held-out set)",
                              check=">=1")


@dataclasses.dataclass(frozen=True)
class Checkpoint:
  """Orbax checkpoints of the run (learner, ledger, counters)."""
  every_steps: int = _f(50, "orbax checkpoint period (0 = never); always one at the end",
                        check=">=0")
  max_to_keep: int = _f(2, "newest complete checkpoints kept", check=">=1")
  resume: bool = _f(True, "continue from the latest complete checkpoint in run_dir")


@dataclasses.dataclass(frozen=True)
class Mesh:
  """The learner's device mesh."""
  shape: str = _f("", "e.g. 'data=1,fsdp=-1' (-1 = remaining devices); '' = one device")
  tokens_per_device: int = _f(0, "padded tokens per device per micro-batch (0 = no "
                              "accumulation)", check=">=0")


@dataclasses.dataclass(frozen=True)
class Distributed:
  """jax.distributed (or the environment's JAX_COORDINATOR_ADDRESS ...)."""
  coordinator_address: str = _f("", "'host:port' of process 0; '' = single process")
  num_processes: int = _f(-1, "processes in the job (-1 = from the environment)")
  process_id: int = _f(-1, "this process (-1 = from the environment)")
  cpu_collectives: str = _f("gloo", "CPU cross-process collectives ('' = JAX's default)",
                            choices=("gloo", "mpi", ""))


@dataclasses.dataclass(frozen=True)
class Log:
  """Metrics sinks and the console."""
  tensorboard: bool = _f(True, "TensorBoard event files under run_dir/tb")
  progress: str = _f("auto", "'auto' (bar on a terminal, plain lines otherwise), 'bar', 'lines', "
                     "'off'", choices=_progress)
  wandb_project: str = _f("", "Weights & Biases project name ('' = off; needs `pip install "
                          "wandb`)")


@dataclasses.dataclass(frozen=True)
class Run:
  """A whole run: the top-level fields and one role per section."""
  seed: int = _f(0, "one seed for model init, data order, sampling", check=">=0")
  run_dir: str = _f("runs/arith_tool", "metrics.jsonl/.csv, results.csv, tb/, checkpoints/")
  allow_random_init: bool = _f(True, "start from a random model (+ SFT) when no checkpoint is "
                               "given")
  task: Task = dataclasses.field(default_factory=Task)
  model: Model = dataclasses.field(default_factory=Model)
  sft: SFT = dataclasses.field(default_factory=SFT)
  rollout: Rollout = dataclasses.field(default_factory=Rollout)
  train: Train = dataclasses.field(default_factory=Train)
  eval: Eval = dataclasses.field(default_factory=Eval)
  checkpoint: Checkpoint = dataclasses.field(default_factory=Checkpoint)
  mesh: Mesh = dataclasses.field(default_factory=Mesh)
  distributed: Distributed = dataclasses.field(default_factory=Distributed)
  log: Log = dataclasses.field(default_factory=Log)


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(Run)
                             if f.default_factory is not dataclasses.MISSING
                             and dataclasses.is_dataclass(f.default_factory)}


@dataclasses.dataclass(frozen=True)
class FieldSpec:
  """One config field as validation and the docs see it."""
  name: str  # dotted, e.g. "train.eps_low"
  default: Any
  doc: str
  types: tuple
  check: Optional[str]
  choices: Any  # tuple, a function returning one, or None

  def allowed(self) -> Optional[tuple]:
    """The allowed values (a registry's keys are read now), or None when not an enum."""
    return self.choices() if callable(self.choices) else self.choices


def _types_of(default, override) -> tuple:
  if override:
    return tuple(override)
  if isinstance(default, bool):
    return (bool,)
  if isinstance(default, float):
    return (int, float)
  if isinstance(default, tuple):
    return (tuple, list)  # a list (e.g. from a JSON round trip) becomes a tuple
  return (type(default),)


def _specs_of(cls, prefix: str) -> list[FieldSpec]:
  out = []
  for f in dataclasses.fields(cls):
    if prefix == "" and f.name in SECTIONS:
      continue
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    md = f.metadata
    out.append(FieldSpec(prefix + f.name, default, md["doc"], _types_of(default, md["types"]),
                         md["check"], md["choices"]))
  return out


def fields() -> dict[str, FieldSpec]:
  """Every config field by dotted name, in declaration order (top level first)."""
  specs = _specs_of(Run, "")
  for sec, cls in SECTIONS.items():
    specs += _specs_of(cls, sec + ".")
  return {s.name: s for s in specs}


def default_config() -> ml_collections.ConfigDict:
  """The ConfigDict of every field's default: where ``configs/*.py`` start."""
  c = ml_collections.ConfigDict()
  for name, spec in fields().items():
    *path, key = name.split(".")
    node = c
    for p in path:
      if p not in node:
        node[p] = ml_collections.ConfigDict()
      node = node[p]
    default = spec.default
    node[key] = ml_collections.ConfigDict(default) if isinstance(default, dict) else default
  return c


_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    ">=0": (lambda v: v >= 0, "must be >= 0"),
    ">0": (lambda v: v > 0, "must be > 0"),
    ">=1": (lambda v: v >= 1, "must be >= 1"),
    ">=-1": (lambda v: v >= -1, "must be >= -1"),
    "[0,1]": (lambda v: 0 <= v <= 1, "must be in [0, 1]"),
    "[0,1)": (lambda v: 0 <= v < 1, "must be in [0, 1)"),
}


class ConfigError(ValueError):
  """A config that cannot run; ``problems`` lists one line per bad field, each
  ``config.<field> = <value>: <what is wrong>; fix: <how>``."""

  def __init__(self, problems: list[str]):
    self.problems = problems
    super().__init__("invalid config (nothing was built or compiled):\n  " + "\n  ".join(problems))


def flatten(config) -> dict[str, Any]:
  """``{"train.eps_low": 0.3, ...}`` of a ConfigDict (or dict); a dict-valued field
  (``rollout.ray_resources``) stays one value."""
  known = fields()
  out = {}

  def walk(d, prefix):
    for k, v in d.items():
      key = f"{prefix}{k}"
      spec = known.get(key)
      if hasattr(v, "items") and not (spec is not None and dict in spec.types):
        walk(v, key + ".")
      else:
        out[key] = dict(v.items()) if hasattr(v, "items") else v
  walk(config, "")
  return out


def _similar(a: str, b: str) -> bool:
  return difflib.SequenceMatcher(None, a, b).ratio() >= 0.75


def field_problems(flat: dict[str, Any]) -> tuple[list[str], set[str]]:
  """(problems, the fields they name) for unknown keys, wrong types, non-finite numbers, enum
  values and ranges: every check a field's declaration carries."""
  known = fields()
  problems, bad = [], set()
  for k, v in flat.items():
    spec = known.get(k)
    if spec is None:
      bad.add(k)
      close = [s for s in known if s.split(".")[-1] == k.split(".")[-1] or
               (s.split(".")[0] == k.split(".")[0] and _similar(s.split(".")[-1],
                                                                k.split(".")[-1]))]
      problems.append(f"config.{k}: unknown key; fix: remove it"
                      + (f" or use {', '.join('config.' + c for c in close[:3])}" if close else ""))
      continue
    types = spec.types
    if (bool in types and not isinstance(v, bool) or bool not in types and isinstance(v, bool)
        or not isinstance(v, types)):
      bad.add(k)
      problems.append(f"config.{k} = {v!r}: wrong type {type(v).__name__}; fix: give a "
                      f"{' or '.join(t.__name__ for t in types)}")
      continue
    if isinstance(v, float) and not math.isfinite(v):
      bad.add(k)
      problems.append(f"config.{k} = {v!r}: must be finite; fix: give a finite number")
      continue
    allowed = spec.allowed()
    if allowed is not None and v not in allowed:
      bad.add(k)
      close = difflib.get_close_matches(str(v), [str(c) for c in allowed], n=1, cutoff=0.6)
      fix = f"use {close[0]!r}" if close else f"use {allowed[0]!r}"
      problems.append(f"config.{k} = {v!r}: must be one of {allowed}; fix: {fix}")
      continue
    if spec.check is not None:
      ok, what = _CHECKS[spec.check]
      if not ok(v):
        bad.add(k)
        problems.append(f"config.{k} = {v!r}: {what} ({spec.doc}); fix: use e.g. "
                        f"{spec.default!r}")
  return problems, bad


def _build(cls, flat: dict, prefix: str):
  kw = {}
  for f in dataclasses.fields(cls):
    if prefix == "" and f.name in SECTIONS:
      kw[f.name] = _build(SECTIONS[f.name], flat, f.name + ".")
      continue
    key = prefix + f.name
    if key not in flat:
      continue
    v = flat[key]
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    if isinstance(default, float) and isinstance(v, int) and not isinstance(v, bool):
      v = float(v)
    elif isinstance(default, tuple):
      v = tuple(v)
    elif isinstance(default, dict):
      v = dict(v)
    kw[f.name] = v
  return cls(**kw)


def from_config(config) -> Run:
  """The typed ``Run`` of an ml_collections ConfigDict (or nested dict): missing fields take their
  defaults, an int given for a float field becomes a float, lists become tuples.

  Raises ``ConfigError`` listing every unknown key (with the closest known names), wrong type,
  non-finite number, value outside its ``choices`` and out-of-range value, each with its fix.
  Cross-field rules are ``train/validation.py``'s."""
  flat = flatten(config)
  problems, _ = field_problems(flat)
  if problems:
    raise ConfigError(problems)
  return _build(Run, flat, "")


def to_config(run: Run) -> ml_collections.ConfigDict:
  """The ConfigDict of a ``Run`` (for code that still takes one, and for checkpoint metadata)."""
  return ml_collections.ConfigDict(dataclasses.asdict(run))

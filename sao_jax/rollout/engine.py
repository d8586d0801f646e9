"""A JetStream ``engine_api.Engine`` for the sao_jax decoder that also returns log-probs.

Continuous batching over ``max_concurrent_decodes`` decode slots, the JetStream way:

* ``prefill(params, existing_prefix, padded_tokens, true_length) -> Prefix`` runs the prompt (or,
  with ``existing_prefix``, a chunk appended after an existing KV cache: the multi-turn hook for
  environment observations) and samples the first token;
* ``insert(prefix, decode_state, slot)`` copies that KV cache into a slot;
* ``generate(params, decode_state)`` feeds every slot's last sampled token, samples the next one
  and returns ``LogProbResultTokens`` (JetStream's ``ResultTokens`` plus a ``logprobs`` array).

Two batched calls beside the JetStream API, which the rollout worker uses (``benchmarks/
bench_sampler.py`` measures both paths in one run, ``benchmarks/bench_rollout.py`` both in the
multi-turn worker):

* ``prefill_insert(params, decode_state, slots, prompts, starts=)`` prefills several chunks in
  one compiled call straight into their slots' rows of the decode-state cache (one scatter of
  the new entries per layer, in place under donation): fresh prompts (``starts`` 0) instead of
  one ``prefill`` + ``insert`` pair per prompt, and multi-turn observations after a slot's true
  length instead of ``slot_prefix`` + ``prefill`` + ``insert``;
* ``generate_steps(params, decode_state, n)`` runs ``n`` decode steps in one ``lax.scan`` (the
  same key splits as ``n`` ``generate`` calls, so the same draws) and returns the tokens and
  log-probs ``[slots, n]``; the host checks stops once per call and discards what a slot sampled
  past the end of its turn (``RolloutWorker(decode_steps=)``, ``rollout.decode_steps``).

Sampling and log-probs (what DIS needs): the token is drawn from ``softmax(logits / temperature)``
and the recorded log-prob is ``log_softmax(logits / temperature)[token]`` -- the distribution that
was actually sampled. ``temperature == 0`` means greedy (argmax); its recorded log-prob is that of
the temperature-1 distribution. No top-k/top-p: their log-probs would belong to a truncated
distribution the trainer does not recompute.

Layout on a mesh (``SAOEngine(mesh=)``, axes ``data``, ``tensor``, ``expert``, any of size 1;
default one device). Each parameter's logical axes (``models/partition.py``) map to the engine's
mesh axes by one table, ``train.sharding.ROLLOUT_RULES``, and the KV cache uses the same names:

=============  ===========================================================================
``data``       decode slots: device row d holds slots ``d * S/n .. (d + 1) * S/n - 1`` of
               the decode state (cache, lengths, tokens, log-probs); weights replicated
``tensor``     attention heads (q / o projections) and KV heads (k / v projections and the
               KV cache ``[slots, kv_heads, ...]``), the MLP hidden (dense and per expert),
               the vocabulary (embedding, LM head); ``n_kv_heads`` must be a multiple of it
``expert``     MoE experts (``[experts, ...]`` weights, router columns)
other axes     replicate (e.g. a learner mesh's ``fsdp`` axis)
=============  ===========================================================================

``param_shardings(params)`` gives that layout (publish weights into it with ``jax.device_put``;
``load_params`` does), and every compiled call constrains its params to it (replicated params
are sliced in place) and its decode state to the cache layout. The ``data`` axis is the manual
axis of a ``jax.shard_map`` (``generate``, ``generate_steps``, ``prefill_insert`` and ``insert``
run per slot group, no communication across ``data``: plain ``jit`` on that state put an
all-gather into every cache write; ``slot_prefix`` reads a slot out with one ``psum``);
``tensor`` and ``expert`` stay automatic, so XLA's SPMD partitioner inserts their collectives
(all-reduces after the o / down / expert projections, gathers of small activations where an
op needs a whole axis, such as the sampler's logits and the router's scores; no weight is
gathered in a decode step: ``tests/unit/rollout/test_engine_tensor_parallel.py``). Sums split over
devices change float32 rounding, so log-probs match one device within the tests' 1e-5, not
bit for bit.
A row's uniforms are its slice of one draw for all rows, so the tokens are those of one device
(``tests/unit/rollout/test_engine_data_parallel.py``,
``tests/unit/rollout/test_engine_tensor_parallel.py``). On a CPU
host the ``data`` axis is how the engine uses several cores: XLA:CPU spreads one small decode
step poorly over two threads, while two host devices (``--xla_force_host_platform_device_count
=2``: two XLA devices, whose programs can run at the same time) each decoding half the slots
overlap, which raises tokens/s most at many slots. A multi-turn rollout of one-row prefills is
slower split (each call runs on every device). Measurements: ``benchmarks/RESULTS.md`` section 2.

KV-cache layout: per layer ``k [slots, n_kv_heads, head_dim, cache_len]`` (keys transposed) and
``v [slots, n_kv_heads, cache_len, head_dim]`` (``transformer.init_cache``);
``cache_len = max_seq_len + 1`` (positions 0 .. max_seq_len; the last sampled token of a full
sequence is written at max_seq_len): the padded tail of a prefill chunk past the end is dropped
by the write (``transformer.write_cache``), so the cache needs no ``max_prefill_length`` of slack.
The decode state is donated to ``generate``, ``generate_steps``, ``insert`` and
``prefill_insert``, whose cache writes (one position of every slot per step; one slot's rows per
insert; a chunk's positions per prefilled row) update it in place.

Live length: attention reads only the first ``kv_len`` cache positions, ``kv_len`` the smallest
bucket ``kv_bucket * 2**i`` above the longest slot, or the whole cache when that bucket is more
than half of it, so the number of compiled shapes stays ~log2(cache_len / kv_bucket). (The
cut-off is measured on XLA:CPU: slicing the cache costs a copy of the live part, which loses to
reading a small, cache-resident KV cache in full and wins once it spills out of the CPU cache; a
quarter-cache cut-off measured the same as half: ``benchmarks/RESULTS.md`` section 2.) The
engine knows every slot's length on the host
(``DecodeState.host_lengths``, ``Prefix.host_length``: static fields, stripped before each jitted
call so they never key a compile) and so picks the bucket without waiting on the device.
Idle slots still advance (``generate`` computes every slot), so a drained slot's length -- and
with it the bucket -- grows until the slot is refilled. Cache positions at or past a slot's
length are never read (the causal mask on absolute positions hides them), so neither idle
decoding nor a new prompt needs to clear them: ``prefill_insert`` writes a fresh prompt, or a
multi-turn observation after a slot's true length, straight into the decode state.
"""

from __future__ import annotations

import functools
import itertools
import threading
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax.sharding import NamedSharding, PartitionSpec

from sao_jax.models.transformer import ModelConfig, init_cache
from sao_jax.train import sharding
from sao_jax.rollout.jetstream_compat import engine_api, tokenizer_api, tokenizer_pb2


@struct.dataclass
class Prefix:
  """KV cache of one sequence plus its first sampled token.

  cache: per layer k [1, n_kv_heads, head_dim, cache_len], v [1, n_kv_heads, cache_len,
  head_dim]; length: int32 [] tokens in the cache; token: int32 [] sampled next token (not yet
  in the cache); logprob: float32 [];
  host_length: ``length`` as a Python int when the engine knows it (static, not a pytree leaf).
  """
  cache: Any
  length: jax.Array
  token: jax.Array
  logprob: jax.Array
  host_length: Optional[int] = struct.field(pytree_node=False, default=None)


@struct.dataclass
class DecodeState:
  """All slots. lengths/tokens/logprobs: [slots]; ``tokens`` are sampled but not yet cached.
  host_lengths: ``lengths`` as a tuple of Python ints (static; None = unknown, read from the
  device when needed)."""
  cache: Any
  lengths: jax.Array
  tokens: jax.Array
  logprobs: jax.Array
  rng: jax.Array
  host_lengths: Optional[tuple] = struct.field(pytree_node=False, default=None)


@struct.dataclass
class LogProbResultTokens(engine_api.ResultTokens):
  """JetStream ResultTokens plus ``logprobs: float32 [slots, 1]`` of the sampled tokens."""
  logprobs: Any = None

  def convert_to_numpy(self) -> "LogProbResultTokens":
    return LogProbResultTokens(np.asarray(self.data), self.tokens_idx, self.valid_idx,
                               self.length_idx, self.samples_per_slot,
                               np.asarray(self.logprobs))


def first_argmax(x: jax.Array) -> jax.Array:
  """``jnp.argmax(x, -1)`` (the first index of the maximum) as a max and a min reduction, which
  XLA:CPU runs several times faster than its variadic argmax reduction (``benchmarks/RESULTS.md``
  section 2). x: float [..., V] without NaNs. Returns int32 [...]."""
  top = jnp.max(x, axis=-1, keepdims=True)
  iota = jnp.arange(x.shape[-1], dtype=jnp.int32)
  return jnp.min(jnp.where(x == top, iota, x.shape[-1] - 1), axis=-1)


def inverse_cdf_tokens(probs: jax.Array, uniforms: jax.Array) -> jax.Array:
  """Draws one index per row of ``probs`` by a two-level inverse CDF.

  probs: float32 [..., V], non-negative, not necessarily normalised (a row needs some mass);
  uniforms: float32 [..., 2] in [0, 1). Returns int32 [...]: index i with probability
  ``probs[i] / sum(probs)`` (up to float32 rounding of the partial sums).

  The vocabulary is cut into ``nb`` blocks of ``bs`` (``bs`` the power of two >= sqrt(V), the
  tail padded with zeros). The first uniform picks a block by the cumulative block masses, the
  second a token inside it by that block's cumulative masses: P(block) * P(token | block) =
  probs[i] / sum(probs). Both cumulative sums are small triangular matmuls (``HIGHEST``
  precision, so no bf16/TF32 passes on an accelerator). Each level takes the first entry *with
  mass* whose cumulative sum exceeds u * total, so an entry of probability 0 (a -inf logit) is
  never drawn even where the matmul's rounding makes a zero-mass entry's sum differ from its
  predecessor's; a row with no such entry (u * total rounded up, or no mass at all) takes its
  last entry with mass (index 0 for an all-zero row). Only two random numbers per row are
  drawn, against one per vocabulary entry for Gumbel-max, whose threefry bits are most of its
  cost on XLA:CPU (``benchmarks/RESULTS.md`` section 2).

  Float32 limit: the uniforms lie on a 2**-23 grid and the cumulative sums are float32, so an
  entry below ~6e-8 of its level's total (a block of the vocabulary's mass, or a token of its
  block's) is never drawn, and rarer ones are drawn at multiples of ~1.2e-7. The sampled
  distribution is then off by at most ~(nb + bs) * 6e-8 in total variation (~3e-5 at V =
  49152); Gumbel-max in float32 has a floor too (~1e-9). The recorded log-prob is the exact
  ``log_softmax`` of the drawn token.
  """
  *lead, v = probs.shape
  bs = 1 << int(np.ceil(np.log2(np.sqrt(v))))
  nb = -(-v // bs)
  if nb * bs != v:
    probs = jnp.pad(probs, [(0, 0)] * len(lead) + [(0, nb * bs - v)])
  blocks = probs.reshape(*lead, nb, bs)

  def pick(mass, u):  # mass [..., n] -> the first entry with mass whose cumulative sum > u * total
    n = mass.shape[-1]
    cum = jnp.matmul(mass, jnp.triu(jnp.ones((n, n), mass.dtype)),
                     precision=jax.lax.Precision.HIGHEST)
    iota = jnp.arange(n)
    above = (cum > (u * cum[..., -1])[..., None]) & (mass > 0)
    last = jnp.max(jnp.where(mass > 0, iota, 0), axis=-1)
    return jnp.minimum(jnp.min(jnp.where(above, iota, n), axis=-1), last)

  block = pick(blocks.sum(-1), uniforms[..., 0])
  inner = jnp.take_along_axis(blocks, block[..., None, None], axis=-2)[..., 0, :]
  return (block * bs + pick(inner, uniforms[..., 1])).astype(jnp.int32)


def sample_tokens(logits: jax.Array, rng: jax.Array, temperature) -> tuple[jax.Array, jax.Array]:
  """Samples from softmax(logits / temperature); greedy when temperature == 0.

  Args: logits float32 [..., V]; rng PRNG key; temperature float scalar (traced is fine).
  Returns: (tokens int32 [...], logprobs float32 [...]) where logprobs is the log-probability
  of each token under the distribution it was drawn from (temperature 1 when greedy).
  Equals ``sample_tokens_from(logits, jax.random.uniform(rng, [..., 2]), temperature)``, which
  the engine calls with the uniforms of a whole batch sliced to the rows at hand.

  The draw is ``inverse_cdf_tokens(exp(z), uniform(rng, [..., 2]))`` with ``z = logits /
  temperature - max``: sampling from the tempered distribution (exact up to float32, see there)
  with two random numbers per row, not one per vocabulary entry as in Gumbel-max
  (``jax.random.categorical``), whose draws cost several times more on XLA:CPU. The inverse CDF
  takes unnormalised masses, so the log-probability is formed for the drawn token only:
  ``z[token] - log(sum(exp(z)))``, the formula of ``jax.nn.log_softmax``, without writing and
  re-reading the [..., V] log-softmax (faster on XLA:CPU, ``benchmarks/RESULTS.md`` section 2).
  Greedy is the first argmax of the logits (``first_argmax``).
  """
  return sample_tokens_from(logits, jax.random.uniform(rng, (*logits.shape[:-1], 2), jnp.float32),
                            temperature)


def sample_tokens_from(logits: jax.Array, uniforms: jax.Array,
                       temperature) -> tuple[jax.Array, jax.Array]:
  """``sample_tokens`` with its two uniforms per row given: logits float32 [..., V], uniforms
  float32 [..., 2] in [0, 1) (unused when greedy). Returns (tokens int32 [...], logprobs float32
  [...]) as ``sample_tokens``."""
  t = jnp.asarray(temperature, jnp.float32)
  greedy = t <= 0.0
  z = logits / jnp.where(greedy, 1.0, t)
  z = z - jax.lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True))
  mass = jnp.exp(z)
  # a cond, not a select: greedy decoding (eval) skips the sampling work
  tokens = jax.lax.cond(
      greedy, lambda: first_argmax(logits),
      lambda: inverse_cdf_tokens(mass, uniforms.astype(z.dtype)))
  tokens = tokens.astype(jnp.int32)
  z_token = jnp.take_along_axis(z, tokens[..., None], axis=-1)[..., 0]
  return tokens, z_token - jnp.log(jnp.sum(mass, axis=-1))


def live_kv_len(longest: int, cache_len: int, kv_bucket: int = 32) -> int:
  """Live-length bucket: the smallest ``kv_bucket * 2**i`` >= ``longest`` (the cache positions a
  step must attend to), or ``cache_len`` when that bucket is more than half of the cache (see
  the module docstring for the measured cut-off)."""
  n = kv_bucket
  while n < longest:
    n *= 2
  return n if 2 * n <= cache_len else cache_len


def _host_length(prefix: Prefix) -> int:
  """``prefix.length`` as an int: the static mirror, or a device read when it is unknown."""
  return int(prefix.length) if prefix.host_length is None else prefix.host_length


def _host_lengths(state: DecodeState) -> tuple:
  """``state.lengths`` as a tuple of ints: the static mirror, or a device read when unknown."""
  if state.host_lengths is None:
    return tuple(int(n) for n in np.asarray(state.lengths))
  return state.host_lengths


class CharTokenizerAdapter(tokenizer_api.Tokenizer):
  """Wraps any tokenizer with ``encode``/``decode``/``pad_id``/``eos_id``/``bos_id`` as a
  JetStream ``tokenizer_api.Tokenizer``."""

  def __init__(self, tokenizer):
    self._tok = tokenizer

  def encode(self, s: str, **kwargs):
    ids = np.asarray(self._tok.encode(s), np.int32)
    return ids, len(ids)

  def decode(self, token_ids, **kwargs) -> str:
    return self._tok.decode(list(token_ids))

  @property
  def pad_id(self) -> int:
    return self._tok.pad_id

  @property
  def eos_id(self) -> int:
    return self._tok.eos_id

  @property
  def bos_id(self) -> int:
    return self._tok.bos_id


class SAOEngine(engine_api.Engine):
  """JetStream engine for ``sao_jax.models.Transformer`` with per-token log-probs.

  Args:
    model_config: the decoder's ``ModelConfig``.
    graphdef: ``nnx.split(model)[0]`` of a ``Transformer`` with that config.
    tokenizer: object with encode/decode/pad_id/eos_id/bos_id (e.g. ``CharTokenizer``).
    max_concurrent_decodes: number of decode slots.
    max_prefill_length: longest chunk one prefill call takes (prompt or observation).
    temperature: sampling temperature (0 = greedy).
    seed: PRNG seed for sampling.
    mesh: device mesh the engine runs on (default: one device), with axes among ``data``,
      ``tensor``, ``expert`` (see the module docstring's layout). Its ``data`` axis, when
      larger than 1, splits the slots: device row d holds slots ``d * n .. (d + 1) * n - 1``
      (``n = slots / data``) and decodes and prefills them on its own (``jax.shard_map``);
      ``tensor`` and ``expert`` split the weights and the KV cache. The draws are those of one
      device (given JAX's default ``jax_threefry_partitionable=True``; without it they are as
      random but differ). Other axes replicate. Params must be in ``param_shardings``,
      replicated on the mesh or uncommitted (not placed on devices outside it).
    kv_bucket: smallest live-length bucket (cache positions attended to); buckets double from
      it up to ``cache_len``, one compiled decode program each (``rollout.kv_bucket``).
    prefill_rows: the default row count of ``prefill_insert`` per device: "pow2", the next
      power of two of the chunks one device gets (one compiled program per row count and
      chunk length), or "all", every slot of the device (one per chunk length; more padding
      rows) (``rollout.prefill_rows``).

  Raises ValueError for ``kv_bucket < 1``, an unknown ``prefill_rows``, slots not divisible by
  the mesh's ``data`` axis, ``n_kv_heads`` not divisible by its ``tensor`` axis or a ``tensor``
  / ``expert`` axis of ``AxisType.Explicit`` (the messages name ``rollout.mesh``).
  """

  def __init__(self, model_config: ModelConfig, graphdef, tokenizer, *,
               max_concurrent_decodes: int = 32, max_prefill_length: int = 64,
               temperature: float = 1.0, seed: int = 0, mesh: Optional[jax.sharding.Mesh] = None,
               kv_bucket: int = 32, prefill_rows: str = "pow2"):
    if kv_bucket < 1:
      raise ValueError(f"SAOEngine kv_bucket={kv_bucket} must be >= 1 (rollout.kv_bucket).")
    if prefill_rows not in ("pow2", "all"):
      raise ValueError(f"SAOEngine prefill_rows={prefill_rows!r} must be 'pow2' or 'all' "
                       "(rollout.prefill_rows).")
    self.prefill_rows = prefill_rows
    self.kv_bucket = int(kv_bucket)
    self.cfg = model_config
    self.graphdef = graphdef
    self.tokenizer = tokenizer
    self._slots = max_concurrent_decodes
    self._max_prefill = max_prefill_length
    self.temperature = float(temperature)
    self.cache_len = model_config.max_seq_len + 1
    self._mesh = mesh or jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    shape = dict(self._mesh.shape)
    self._dp = int(shape.get("data", 1))  # devices the slots are split over
    if max_concurrent_decodes % self._dp:
      raise ValueError(f"rollout.slots (max_concurrent_decodes)={max_concurrent_decodes} must be "
                       f"a multiple of the engine mesh's data axis ({self._dp} devices): each "
                       f"device holds as many slots")
    tp = int(shape.get("tensor", 1))
    kv = model_config.n_kv_heads
    if kv % tp:
      raise ValueError(f"rollout.mesh tensor={tp} does not divide the model's {kv} KV heads "
                       f"(n_kv_heads): the KV cache is split by KV heads; use a tensor size that "
                       f"divides {kv} (put the other devices on data or expert)")
    # tensor / expert axes of size > 1: the weights and the KV cache are split over them (XLA's
    # SPMD partitioner inserts the collectives); without them params are taken as they come
    self._model_parallel = any(int(shape.get(a, 1)) > 1 for a in ("tensor", "expert"))
    explicit = [a for a, t in zip(self._mesh.axis_names, self._mesh.axis_types)
                if a in ("tensor", "expert") and shape[a] > 1
                and t == jax.sharding.AxisType.Explicit]
    if explicit:
      raise ValueError(f"rollout.mesh axes {explicit} are Explicit; the engine's tensor and "
                       f"expert axes must be Auto (XLA partitions the model over them): build "
                       f"the mesh with sharding.make_mesh")
    self._base_key = jax.random.key(seed)
    self._counter = itertools.count()
    self._lock = threading.Lock()
    # per-slot arrays along the data axis; a mesh without one replicates them (as params).
    # ``state_spec`` names the data axis only (shard_map's manual axis); the decode state's
    # shardings add the KV heads on tensor (``sharding.ROLLOUT_RULES``, as the params)
    split = PartitionSpec("data" if "data" in self._mesh.axis_names else None)
    rep = PartitionSpec()
    state_spec = DecodeState(cache=[(split, split)] * model_config.n_layers, lengths=split,
                             tokens=split, logprobs=split, rng=rep)
    cfg = model_config
    k_spec, v_spec = (sharding.logical_to_spec(axes, dims, self._mesh, sharding.ROLLOUT_RULES)
                      for axes, dims in (
                          (("batch", "kv_heads", "head_dim", "length"),
                           (self._slots, cfg.n_kv_heads, cfg.head_dim, self.cache_len)),
                          (("batch", "kv_heads", "length", "head_dim"),
                           (self._slots, cfg.n_kv_heads, self.cache_len, cfg.head_dim))))
    self._state_sharding = jax.tree.map(
        lambda p: NamedSharding(self._mesh, p),
        state_spec.replace(cache=[(k_spec, v_spec)] * cfg.n_layers),
        is_leaf=lambda x: isinstance(x, PartitionSpec))
    self._prefill_jit = jax.jit(self._place(self._prefill_impl),
                                static_argnames=("has_prefix", "kv_len"))
    self._generate_jit = jax.jit(
        self._place(self._split_slots(self._generate_impl, (rep, state_spec, rep),
                                      (state_spec, split)), state_out=0),
        donate_argnums=(1,), static_argnames=("kv_len",))
    self._insert_jit = jax.jit(
        self._place(self._split_slots(self._insert_impl, (rep, state_spec, rep), state_spec),
                    params=False, state_out=-1),
        donate_argnums=(1,))
    self._slot_prefix_jit = jax.jit(self._split_slots(self._slot_prefix_impl, (state_spec, rep),
                                                      rep))
    self._prefill_insert_jit = jax.jit(
        self._place(self._split_slots(
            self._prefill_insert_impl,
            (rep, state_spec, split, split, split, split, split, rep, rep),
            (state_spec, split, split)), state_out=0),
        donate_argnums=(1,), static_argnames=("kv_len",))
    self._generate_steps_jit = jax.jit(
        self._place(self._split_slots(self._generate_steps_impl, (rep, state_spec, rep),
                                      (state_spec, split, split)), state_out=0),
        donate_argnums=(1,), static_argnames=("kv_len", "num_steps"))
    self._compiled_for = set()  # decode-state shapes whose live-length buckets are compiled

  # ---- pure implementations -------------------------------------------------------------------
  def kv_len_for(self, longest: int) -> int:
    """``live_kv_len(longest, self.cache_len, self.kv_bucket)``."""
    return live_kv_len(longest, self.cache_len, self.kv_bucket)

  def _prefill_impl(self, params, cache, start, tokens, true_length, rng, temperature, *,
                    has_prefix, kv_len):
    if not has_prefix:  # a fresh one-row cache, allocated inside the compiled prefill
      cache = init_cache(self.cfg, 1, self.cache_len)
    model = nnx.merge(self.graphdef, params)
    positions = (start + jnp.arange(tokens.shape[0], dtype=jnp.int32))[None]
    h, cache = model.hidden(tokens[None], positions, cache, kv_len=kv_len)
    # the LM head on the last true token only (not on every padded chunk position)
    h_last = jax.lax.dynamic_slice_in_dim(h[0], true_length - 1, 1, axis=0)
    last = model.logits_from_hidden(h_last)[0]
    token, logprob = sample_tokens(last, jax.random.fold_in(*rng), temperature)
    return Prefix(cache=cache, length=start + true_length, token=token, logprob=logprob)

  def param_shardings(self, params: Any) -> Any:
    """``NamedSharding`` pytree of the engine's weight layout for ``params`` (a pure-dict params
    pytree of arrays or ``jax.ShapeDtypeStruct``s): each parameter's logical axes
    (``models.partition``) mapped to this engine's mesh by ``sharding.ROLLOUT_RULES`` (heads,
    KV heads, MLP hidden and vocabulary on ``tensor``, experts on ``expert``, replicated over
    ``data``). ``jax.device_put(params, engine.param_shardings(params))`` publishes weights
    straight into that layout (``load_params`` does it)."""
    return sharding.param_shardings(params, self._mesh, sharding.ROLLOUT_RULES)

  def _place(self, impl, *, params: bool = True, state_out: Optional[int] = None):
    """``impl`` with its params (the first argument, when ``params``) constrained to
    ``param_shardings`` and its decode-state output (output ``state_out``; -1: the output is
    the state) to the decode state's shardings, so XLA's SPMD partitioner runs the model tensor
    / expert parallel and the cache stays split over KV heads. Replicated params are sliced in
    place (no communication); params already in the layout pass unchanged. ``impl`` itself
    when the mesh has no tensor / expert axis of size > 1."""
    if not self._model_parallel:
      return impl
    constrain = jax.lax.with_sharding_constraint

    @functools.wraps(impl)  # keeps the signature, for jit's static_argnames
    def run(*args, **static):
      if params:
        args = (constrain(args[0], self.param_shardings(args[0])), *args[1:])
      out = impl(*args, **static)
      if state_out == -1:
        return constrain(out, self._state_sharding)
      if state_out is not None:
        out = list(out)
        out[state_out] = constrain(out[state_out], self._state_sharding)
        out = tuple(out)
      return out
    return run

  def _split_slots(self, impl, in_specs, out_specs):
    """``impl`` run per device on its share of the slots when the mesh's data axis splits them
    (``jax.shard_map`` manual over ``data`` only: per-slot arrays ``P("data")``, params / keys
    / scalars replicated, no collective across ``data``; the tensor and expert axes stay
    automatic, see ``_place``); ``impl`` itself on one device."""
    if self._dp == 1:
      return impl

    explicit = jax.sharding.AxisType.Explicit in self._mesh.axis_types

    @functools.wraps(impl)  # keeps the signature, for jit's static_argnames
    def run(*args, **static):
      if explicit:  # an Explicit-axes mesh takes inputs only as in_specs lays them out
        args = jax.tree.map(
            lambda spec, sub: jax.tree.map(
                lambda x: jax.sharding.reshard(x, NamedSharding(self._mesh, spec)), sub),
            tuple(in_specs), args, is_leaf=lambda x: isinstance(x, PartitionSpec))
      return jax.shard_map(functools.partial(impl, **static), mesh=self._mesh, in_specs=in_specs,
                           out_specs=out_specs, axis_names=frozenset({"data"}),
                           check_vma=False)(*args)
    return run

  def _uniforms(self, key, n: int, rows=None):
    """Two uniforms per row: those of rows ``rows`` (int32 [n]; default this device's slots)
    out of ``uniform(key, [n * devices, 2])``, so a row's draw is the same whether the slots are
    split over devices or not. That needs ``jax_threefry_partitionable`` (JAX's default), under
    which a prefix of a larger draw is the smaller draw."""
    u = jax.random.uniform(key, (n * self._dp, 2), jnp.float32)
    if rows is not None:
      return u[rows]
    if self._dp == 1:
      return u
    return jax.lax.dynamic_slice_in_dim(u, jax.lax.axis_index("data") * n, n)

  def _generate_impl(self, params, state: DecodeState, temperature, *, kv_len):
    model = nnx.merge(self.graphdef, params)
    rng, sub = jax.random.split(state.rng)
    logits, cache = model(state.tokens[:, None], state.lengths[:, None], state.cache,
                          kv_len=kv_len)
    tokens, logprobs = sample_tokens_from(logits[:, 0], self._uniforms(sub, logits.shape[0]),
                                          temperature)
    lengths = jnp.minimum(state.lengths + 1, self.cfg.max_seq_len)
    new_state = DecodeState(cache=cache, lengths=lengths, tokens=tokens, logprobs=logprobs,
                            rng=rng)
    data = jnp.stack([tokens, jnp.ones_like(tokens), lengths], axis=-1)
    result = LogProbResultTokens(data=data, tokens_idx=(0, 1), valid_idx=(1, 2),
                                 length_idx=(2, 3), samples_per_slot=1,
                                 logprobs=logprobs[:, None])
    return new_state, result

  def _generate_steps_impl(self, params, state: DecodeState, temperature, *, kv_len, num_steps):
    def body(st, _):
      st, _ = self._generate_impl(params, st, temperature, kv_len=kv_len)
      return st, (st.tokens, st.logprobs)
    state, (tokens, logprobs) = jax.lax.scan(body, state, None, length=num_steps)
    return state, tokens.T, logprobs.T

  def _prefill_insert_impl(self, params, state: DecodeState, slots, tokens, true_lengths,
                           starts, draws, rng, temperature, *, kv_len):
    n, t = tokens.shape
    model = nnx.merge(self.graphdef, params)
    positions = starts[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
    # each chunk straight into its slot's rows of the decode-state cache (writes in place)
    h, cache = model.hidden(tokens, positions, state.cache, kv_len=kv_len, cache_rows=slots)
    h_last = jnp.take_along_axis(h, (true_lengths - 1)[:, None, None], axis=1)  # [n, 1, D]
    # row r's uniforms are those of row draws[r] (its place among the call's chunks)
    new_tokens, logprobs = sample_tokens_from(
        model.logits_from_hidden(h_last)[:, 0],
        self._uniforms(jax.random.fold_in(*rng), n, draws), temperature)
    put = lambda x, u: x.at[slots].set(u.astype(x.dtype), unique_indices=True, mode="drop")
    state = state.replace(cache=cache, lengths=put(state.lengths, starts + true_lengths),
                          tokens=put(state.tokens, new_tokens),
                          logprobs=put(state.logprobs, logprobs))
    return state, new_tokens, logprobs

  def _local_slot(self, slot, state: DecodeState):
    """``slot`` (global) as an index into this device's slots: out of 0 .. n - 1 on a device
    that does not hold it (the whole range on one device)."""
    if self._dp == 1:
      return slot
    return slot - jax.lax.axis_index("data") * state.lengths.shape[0]

  def _insert_impl(self, prefix: Prefix, state: DecodeState, slot):
    if self._dp == 1:
      cache = [(jax.lax.dynamic_update_slice_in_dim(k, pk, slot, axis=0),
                jax.lax.dynamic_update_slice_in_dim(v, pv, slot, axis=0))
               for (k, v), (pk, pv) in zip(state.cache, prefix.cache)]
      return state.replace(cache=cache, lengths=state.lengths.at[slot].set(prefix.length),
                           tokens=state.tokens.at[slot].set(prefix.token),
                           logprobs=state.logprobs.at[slot].set(prefix.logprob))
    # slots split: the device holding ``slot`` writes it, the others drop the write
    at = self._local_slot(slot, state)
    put = lambda x, u: x.at[at].set(u.astype(x.dtype), mode="drop")
    cache = [(put(k, pk[0]), put(v, pv[0])) for (k, v), (pk, pv) in zip(state.cache, prefix.cache)]
    return state.replace(cache=cache, lengths=put(state.lengths, prefix.length),
                         tokens=put(state.tokens, prefix.token),
                         logprobs=put(state.logprobs, prefix.logprob))

  def _slot_prefix_impl(self, state: DecodeState, slot):
    at = self._local_slot(slot, state)
    if self._dp == 1:
      take = lambda x: jax.lax.dynamic_slice_in_dim(x, at, 1, axis=0)
    else:  # slots split: the holder's rows, summed with the others' zeros (one psum)
      own = (at >= 0) & (at < state.lengths.shape[0])
      at = jnp.clip(at, 0, state.lengths.shape[0] - 1)
      take = lambda x: jax.lax.psum(
          jnp.where(own, jax.lax.dynamic_slice_in_dim(x, at, 1, axis=0), jnp.zeros((), x.dtype)),
          "data")
    cache = [(take(k), take(v)) for k, v in state.cache]
    return Prefix(cache=cache, length=take(state.lengths)[0], token=take(state.tokens)[0],
                  logprob=take(state.logprobs)[0])

  def reseed(self, seed: int) -> None:
    """Restarts the engine's sampling key stream at ``seed`` (deterministic / resumed rollout)."""
    with self._lock:
      self._base_key = jax.random.key(seed)
      self._counter = itertools.count()

  def _next_key(self):
    """(base key, counter) of the next prefill draw; the compiled call folds the counter in
    (``jax.random.fold_in``), so no eager op is dispatched per call (``benchmarks/RESULTS.md``
    section 2)."""
    with self._lock:
      return self._base_key, np.uint32(next(self._counter))

  # ---- JetStream Engine API ---------------------------------------------------------------------
  def prefill(self, *, params, existing_prefix: Optional[Prefix] = None,
              padded_tokens: jax.Array, true_length: int,
              temperature: Optional[float] = None) -> Prefix:
    """Runs ``padded_tokens[:true_length]`` after ``existing_prefix`` (if any) and samples the
    next token. padded_tokens: int32 [T], T <= max_prefill_length (use ``pad_to_bucket``).

    Raises ValueError if the chunk is longer than ``max_prefill_length`` or the sequence would
    exceed ``model.max_seq_len``."""
    padded_tokens = np.asarray(padded_tokens, np.int32)
    if padded_tokens.shape[0] > self._max_prefill:
      raise ValueError(f"prefill chunk of {padded_tokens.shape[0]} tokens exceeds "
                       f"rollout.max_prefill_length={self._max_prefill}; raise it.")
    if existing_prefix is None:
      cache, start, host_start = None, 0, 0
    else:
      cache, start = existing_prefix.cache, existing_prefix.length
      host_start = _host_length(existing_prefix)
    temp = self.temperature if temperature is None else temperature
    # the whole (one-row) cache: a live-length bucket here would multiply the compiled prefill
    # variants (chunk bucket x kv bucket) for little gain at batch 1
    out = self._prefill_jit(params, cache, jnp.asarray(start, jnp.int32), padded_tokens,
                            np.int32(true_length), self._next_key(), np.float32(temp),
                            has_prefix=existing_prefix is not None, kv_len=None)
    return out.replace(host_length=host_start + int(true_length))

  def generate(self, params, decode_state: DecodeState,
               temperature: Optional[float] = None):
    """One decode step for every slot: returns (new DecodeState, LogProbResultTokens)."""
    temp = np.float32(self.temperature if temperature is None else temperature)
    lengths = _host_lengths(decode_state)
    bare = decode_state.replace(host_lengths=None)
    self._compile_buckets(params, bare, temp)
    state, result = self._generate_jit(params, bare, temp, kv_len=self.kv_len_for(max(lengths) + 1))
    cap = self.cfg.max_seq_len
    return state.replace(host_lengths=tuple(min(n + 1, cap) for n in lengths)), result

  def generate_steps(self, params, decode_state: DecodeState, num_steps: int,
                     temperature: Optional[float] = None, to_host: bool = True):
    """``num_steps`` decode steps for every slot in one compiled call (a ``lax.scan`` of the
    step ``generate`` runs, with the same key splits, so the same draws as ``num_steps`` calls of
    ``generate``). The caller reads the tokens on the host afterwards; a slot whose turn ended
    part-way keeps decoding to the end of the call, and those extra tokens and cache entries are
    the caller's to discard (``prefill_insert(..., starts=)`` at the slot's true length, or
    ``slot_prefix(..., length=, token=)`` + ``prefill`` + ``insert``, continue from it).

    Returns (new DecodeState, tokens int32 [slots, num_steps], logprobs float32 [slots,
    num_steps]) as NumPy arrays; with ``to_host=False`` the tokens and log-probs stay device
    arrays and the call returns once dispatched (JAX runs it asynchronously; the host-side
    ``host_lengths`` are already advanced), so the caller can work while it decodes
    (``RolloutWorker(overlap_host=True)``). Raises ValueError for num_steps < 1."""
    if num_steps < 1:
      raise ValueError(f"generate_steps num_steps={num_steps} must be >= 1 (rollout.decode_steps)")
    temp = np.float32(self.temperature if temperature is None else temperature)
    lengths = _host_lengths(decode_state)
    bare = decode_state.replace(host_lengths=None)
    kv_len = self.kv_len_for(max(lengths) + num_steps)
    key = ("steps", num_steps, kv_len) + tuple(jax.tree.map(jnp.shape, jax.tree.leaves(bare)))
    if key not in self._compiled_for:  # every bucket compiled at once (as ``generate`` does)
      for kv in self.live_buckets():
        jax.block_until_ready(self._generate_steps_jit(
            params, jax.tree.map(lambda x: x.copy(), bare), temp, kv_len=kv,
            num_steps=num_steps))
        self._compiled_for.add(key[:2] + (kv,) + key[3:])
    state, tokens, logprobs = self._generate_steps_jit(params, bare, temp, kv_len=kv_len,
                                                      num_steps=num_steps)
    cap = self.cfg.max_seq_len
    state = state.replace(host_lengths=tuple(min(n + num_steps, cap) for n in lengths))
    if to_host:
      tokens, logprobs = jax.device_get((tokens, logprobs))
    return state, tokens, logprobs

  def prefill_insert(self, params, decode_state: DecodeState, slots, prompts,
                     temperature: Optional[float] = None, rows: Optional[int] = None,
                     starts=None):
    """Prefills a chunk into each of ``slots`` in one compiled call and samples each slot's
    next token: the batched, in-place form of ``prefill`` + ``insert``. With ``starts`` None
    (or 0) a chunk is a fresh prompt; with ``starts[r] > 0`` it is appended after the slot's
    first ``starts[r]`` cached positions, with no ``slot_prefix`` copy out and no ``insert``
    copy back: the chunk's keys and values are scattered into the decode-state cache, which is
    donated. A multi-turn observation chunk begins with the slot's pending token (the sampled
    token that ended the turn, not yet cached) at ``starts[r]`` = its position, the slot's true
    length, followed by the observation's tokens. Rows are right-padded to a common length
    ``min(max(8, next power of two), max_prefill_length)``, and the row count to ``rows`` per
    device of the mesh's data axis (default: the engine's ``prefill_rows``, the next power of
    two of the most chunks one device's slots get, at most its slot count, or that slot count;
    padding rows write nowhere), so
    compiles stay few: one per (rows, length) for fresh prompts (which attend over their chunk
    only) and one per (rows, length) for appended chunks (which attend over the whole cache).

    slots: sequence of distinct slot indices in 0 .. slots - 1; prompts: one token-id sequence
    per slot, each of 1 .. ``max_prefill_length`` tokens, with ``start + len`` below
    ``max_seq_len``; starts: ints >= 0, each at most the slot's cached length (None = all 0).
    Returns (new DecodeState, the sampled tokens int32 [len(slots)], their log-probs float32
    [...]) as NumPy arrays. Raises ValueError for a length mismatch, a repeated or out-of-range
    slot, an empty / too long chunk or a start past a slot's cache."""
    slots, prompts = [int(s) for s in slots], [list(p) for p in prompts]
    if len(slots) != len(prompts) or not slots:
      raise ValueError(f"prefill_insert: {len(slots)} slots for {len(prompts)} prompts")
    if len(set(slots)) != len(slots) or not all(0 <= s < self._slots for s in slots):
      raise ValueError(f"prefill_insert: slots {slots} must be distinct and in 0.."
                       f"{self._slots - 1} (rollout.slots={self._slots})")
    starts = [0] * len(slots) if starts is None else [int(s) for s in starts]
    if len(starts) != len(slots):
      raise ValueError(f"prefill_insert: {len(starts)} starts for {len(slots)} slots")
    longest = max(len(p) for p in prompts)
    if min(len(p) for p in prompts) < 1 or longest > self._max_prefill:
      raise ValueError(f"prefill_insert: prompts must have 1..rollout.max_prefill_length="
                       f"{self._max_prefill} tokens; got lengths {[len(p) for p in prompts]}")
    end = max(s + len(p) for s, p in zip(starts, prompts))
    if end >= self.cfg.max_seq_len:
      raise ValueError(f"prefill_insert: a chunk ending at position {end} does not fit "
                       f"model.max_seq_len={self.cfg.max_seq_len}; raise it.")
    host = list(_host_lengths(decode_state))
    for slot, s in zip(slots, starts):
      if not 0 <= s <= host[slot]:
        raise ValueError(f"prefill_insert: starts={s} for slot {slot}, whose cache holds "
                         f"{host[slot]} positions; a start must be 0..the cached length")
    t = min(max(8, 1 << (longest - 1).bit_length()), self._max_prefill)
    # rows of device d: chunks for its slots (d * local .. (d + 1) * local - 1), then padding
    local = self._slots // self._dp
    shard_of = [slot // local for slot in slots]
    most = max(shard_of.count(d) for d in range(self._dp))
    rows = rows or (local if self.prefill_rows == "all"
                    else min(1 << (most - 1).bit_length(), local))
    if rows < most:
      raise ValueError(f"prefill_insert: rows={rows} < {most} prompts for one device's slots")
    n_rows = rows * self._dp
    tokens = np.full((n_rows, t), self.tokenizer.pad_id if self.tokenizer else 0, np.int32)
    lengths = np.ones((n_rows,), np.int32)
    first = np.zeros((n_rows,), np.int32)
    idx = np.full((n_rows,), local, np.int32)  # out of the device's range: dropped by the scatter
    draws = np.zeros((n_rows,), np.int32)  # padding rows' draws are never returned
    at, used = [], [0] * self._dp
    for r, (slot, p, s, d) in enumerate(zip(slots, prompts, starts, shard_of)):
      i = d * rows + used[d]
      used[d] += 1
      tokens[i, :len(p)], lengths[i], idx[i], first[i], draws[i] = p, len(p), slot - d * local, s, r
      at.append(i)
    temp = np.float32(self.temperature if temperature is None else temperature)
    # fresh prompts attend over their chunk only; appended chunks over the whole cache (as
    # ``prefill``: a live-length bucket would multiply the compiled variants)
    kv_len = t if not any(starts) else None
    state, new_tokens, logprobs = self._prefill_insert_jit(
        params, decode_state.replace(host_lengths=None), idx, tokens, lengths, first, draws,
        self._next_key(), temp, kv_len=kv_len)
    for slot, p, s in zip(slots, prompts, starts):
      host[slot] = s + len(p)
    new_tokens, logprobs = jax.device_get((new_tokens, logprobs))
    return state.replace(host_lengths=tuple(host)), new_tokens[at], logprobs[at]

  def live_buckets(self) -> list:
    """Every ``kv_len`` ``generate`` can pick: one compiled decode step each."""
    return sorted({self.kv_len_for(n) for n in range(1, self.cache_len + 1)})

  def _compile_buckets(self, params, state: DecodeState, temp) -> None:
    """On the first ``generate`` for a decode-state shape, runs (so compiles) the decode step of
    every live-length bucket on a copy of the state: no compile happens later in a rollout, when
    the longest slot crosses into a new bucket."""
    key = jax.tree.structure(state), tuple(jax.tree.map(jnp.shape, jax.tree.leaves(state)))
    if key in self._compiled_for:
      return
    for kv_len in self.live_buckets():
      jax.block_until_ready(self._generate_jit(params, jax.tree.map(lambda x: x.copy(), state),
                                               temp, kv_len=kv_len))
    self._compiled_for.add(key)

  def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int) -> DecodeState:
    lengths = list(_host_lengths(decode_state))
    lengths[slot] = _host_length(prefix)
    state = self._insert_jit(prefix.replace(host_length=None),
                             decode_state.replace(host_lengths=None), np.int32(slot))
    return state.replace(host_lengths=tuple(lengths))

  def slot_prefix(self, decode_state: DecodeState, slot: int, length: Optional[int] = None,
                  token: Optional[int] = None) -> Prefix:
    """The KV cache of ``slot`` as a ``Prefix`` (for ``prefill(existing_prefix=...)``): the
    multi-turn continuation hook. Its ``token`` is the last sampled token, not yet cached.
    ``length`` / ``token``: the slot's true cached length and last token when the decode state
    ran past them (``generate_steps`` after a turn ended part-way; cache entries at positions
    >= length are then ignored and later overwritten)."""
    prefix = self._slot_prefix_jit(decode_state.replace(host_lengths=None), np.int32(slot))
    if length is not None:
      prefix = prefix.replace(length=jnp.int32(length), token=jnp.int32(token))
      return prefix.replace(host_length=int(length))
    return prefix.replace(host_length=_host_lengths(decode_state)[slot])

  def init_decode_state(self, seed: int = 0) -> DecodeState:  # pylint: disable=arguments-differ
    n = self._slots
    state = DecodeState(cache=init_cache(self.cfg, n, self.cache_len),
                        lengths=jnp.zeros((n,), jnp.int32), tokens=jnp.zeros((n,), jnp.int32),
                        logprobs=jnp.zeros((n,), jnp.float32), rng=jax.random.key(seed),
                        host_lengths=(0,) * n)
    if self._mesh.size > 1:  # on the engine's (sub-)mesh: slots split over its data axis
      state = jax.device_put(state.replace(host_lengths=None), self._state_sharding)
      state = state.replace(host_lengths=(0,) * n)
    return state

  def load_params(self, params=None, *args, **kwargs):  # pylint: disable=arguments-differ
    """Params come from the trainer (weight sync); this returns them in the engine's layout:
    ``jax.device_put`` to ``param_shardings`` on a mesh with a tensor or expert axis (a no-op
    for params already there), unchanged otherwise."""
    if params is None:
      raise ValueError("SAOEngine.load_params needs the policy params (pure dict).")
    if self._model_parallel:
      return jax.device_put(params, self.param_shardings(params))
    return params

  def get_prefix_destination_sharding(self) -> Any:
    return None

  def get_tokenizer(self) -> tokenizer_pb2.TokenizerParameters:
    return tokenizer_pb2.TokenizerParameters(path="sao_jax:builtin")

  def build_tokenizer(self, metadata=None) -> tokenizer_api.Tokenizer:
    return CharTokenizerAdapter(self.tokenizer)

  @property
  def max_concurrent_decodes(self) -> int:
    return self._slots

  @property
  def samples_per_slot(self) -> int:
    return 1

  @property
  def max_prefill_length(self) -> int:
    return self._max_prefill

  @property
  def mesh(self) -> jax.sharding.Mesh:
    return self._mesh

  @property
  def state_shardings(self) -> DecodeState:
    """The decode state's shardings (a ``DecodeState`` of ``NamedSharding``): per-slot arrays
    on ``data``, the KV cache also on ``tensor`` (KV heads), the key replicated."""
    return self._state_sharding

  @property
  def colocated_cpus(self):
    return None

  def pad_to_bucket(self, ids) -> tuple[np.ndarray, int]:
    """Right-pads ``ids`` to the next power of two (>= 8, <= max_prefill_length) so prefill
    compiles once per bucket. Returns (padded int32 [T], true_length)."""
    n = len(ids)
    if n == 0 or n > self._max_prefill:
      raise ValueError(f"prefill chunk has {n} tokens; allowed 1..rollout.max_prefill_length="
                       f"{self._max_prefill}.")
    size = min(max(8, 1 << (n - 1).bit_length()), self._max_prefill)
    out = np.full((size,), self.tokenizer.pad_id, np.int32)
    out[:n] = ids
    return out, n

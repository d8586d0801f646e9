"""Rollout worker: drives a JetStream engine with continuous batching over multi-turn envs.

Each loop iteration: pick up the newest weights (between engine calls), fill free slots with new
prompts (``SAOEngine.prefill_insert``; ``prefill`` + ``insert`` for another JetStream engine), run
``decode_steps`` decode steps for all slots (``generate_steps``; one ``generate`` step otherwise),
and route every newly sampled token to its trajectory. When a turn ends (stop token or per-turn
limit) the environment answers: either the trajectory is done and is emitted, or its observation
tokens are appended to the slot's existing KV cache (no recompute of the prefix) and decoding
continues: with ``SAOEngine`` the observations of every turn answered in the same phase of a
loop iteration are written in place into their slots' rows of the decode state by one
``prefill_insert(..., starts=)`` call, as the prompts admitted together are; with another
JetStream engine ``slot_prefix`` + ``prefill(existing_prefix=...)`` + ``insert`` per slot. Every
action token records the engine's log-prob and the policy version that sampled it.

KV cache across weight updates (``kv_on_update``): "keep" (default) keeps the stale KV of tokens
cached before the update -- later tokens are sampled by the new weights attending to keys/values
the old weights computed; "recompute" re-prefills every running slot's whole sequence with the new
weights (cost: one prefill of the prefix per slot per update), so every later token is sampled
exactly as the new policy would. In both modes the tokens already generated keep the log-probs
and versions they were sampled with (the behaviour policy DIS corrects for).

A trajectory ends on a stop token (eos or a tool call the env answers), a stop string
(``stop_strings``, matched on the decoded turn, read incrementally: ``TurnText``), the env's
``done`` (its max turns), the worker's ``max_turns`` or a length limit (per-turn
``max_new_tokens`` or ``max_seq_len``; recorded as ``truncated``); ``info["finish_reason"]`` says
which. With ``admission`` (``AdmissionControl``)
a new rollout starts only when AReaL's staleness rule allows it.

Environment steps (``env_workers``): with 0 (the default) ``env.step`` is called inline in the
decode loop, so a slow step (a tool call that waits on a sandbox) stops decoding for *every* slot
until it returns; the rollout is then fully deterministic given the seed. With ``env_workers > 0``
a finished turn's ``env.step`` runs on a thread pool of that size: the slot sits out of decoding
(its position in ``generate`` still computes, writing only past the slot's true length, and the
result is discarded), the other slots keep decoding, and when the step returns its observation is
prefilled after the slot's true length and the slot rejoins (or the trajectory is emitted). A
JetStream engine other than ``SAOEngine`` has its slot's cache set aside first
(``engine.slot_prefix``), since its decode step need not write by position. Which generate step
a slot rejoins at depends on thread timing, so sampling is no longer reproducible bit for bit.
``rollout.env_workers`` (config) chooses; see ``env_workers_for``.

Host reads overlapped with decoding (``overlap_host``, ``rollout.overlap_host``; ``SAOEngine``
only): by default each loop iteration dispatches a ``generate_steps`` call and waits for its
tokens, so the device idles while Python routes them and Python idles while the device decodes.
With ``overlap_host=True`` the iteration dispatches call N+1 (JAX dispatch is asynchronous: its
tokens stay device arrays) before it reads call N's tokens and routes them; then only prefills
(admissions, observations), whose first tokens the host needs at once, wait on the device. Call
N+1 was dispatched before the host saw call N's tokens, so a slot whose turn ends in call N, or
that is freed, admitted or prefilled after N+1's dispatch, decodes in N+1 from a state that is
no longer its own: each slot carries an epoch, bumped by every such host-side change, and a
call's tokens for a slot whose epoch moved since the call's dispatch are discarded
(``stats.tokens_discarded``), as are the tokens a slot decodes past the end of its turn inside
one call; the slot's KV entries past its true length are overwritten by its next prefill
(``starts=``). A weight update first reads the call in flight (its tokens belong to the weights
that sampled them); ``close`` drops it (a stopped run abandons its running slots either way).
The draws of the sampler differ from the default's at temperature > 0 (the decode key advances
per step, and a slot rejoins one call later after each turn), so overlap changes which tokens
are sampled, not how: every recorded log-prob is still that of the sampled token.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time
import traceback
from typing import Callable, Iterator, Optional

import numpy as np

from sao_jax.rollout.engine import SAOEngine
from sao_jax.rollout.ledger import Handout
from sao_jax.rollout.staleness import AdmissionControl
from sao_jax.rollout.sync import WeightStore
from sao_jax.rollout.trajectory import Trajectory


@dataclasses.dataclass
class _Slot:
  problem: object
  tokens: list
  action_mask: list
  logprobs: list
  versions: list
  turn: int = 0
  turn_start: int = 0
  t_start: float = 0.0
  tool_calls: int = 0
  position: int = -1  # prompt ledger position (Handout), -1 for a plain problem
  text: Optional["TurnText"] = None  # the turn's incremental detokenisation (stop strings only)


class TurnText:
  """Incremental detokenisation of one turn, for stop strings: work linear in the turn length.

  The rule it implements is the full-decode one: after each token, the turn ends when
  ``tokenizer.decode(turn_tokens).endswith(x)`` for a stop string ``x``. Decoding the whole turn
  on every token is quadratic (a 2048-token turn re-decodes ~2M tokens); this keeps two offsets
  into the turn, as vLLM's ``detokenize_incrementally`` and HF's ``TextStreamer`` do: text is
  read in a small window ``tokens[prefix:]``, of which the part up to ``read`` was already read
  (``prefix_chars`` characters). A token's text can depend on its neighbours (byte-level BPE
  splits a character's UTF-8 bytes over tokens; SentencePiece drops the first token's leading
  space), so the window starts one read step back and new text is read only when the window
  decodes to text that does not end in an unfinished character (U+FFFD); until then the full
  decode ends in U+FFFD too, so no stop string (none contains U+FFFD) can end it. Only the last
  ``max(len(x)) - 1`` characters read are kept to match against.

  Cost per token: one decode of the window plus, when text is read, one of the newly read
  tokens; a window is at most ``MAX_WINDOW`` + 1 tokens (a run of tokens that keeps ending in
  U+FFFD -- invalid bytes, not an unfinished character -- is read as decoded once it reaches
  ``MAX_WINDOW``), so at most ``2 * MAX_WINDOW + 2`` tokens are decoded per token and about 3
  on ordinary text. Exact for decoders whose text up to a finished character does not change
  when tokens are appended (byte-level BPE: SmolLM2, Qwen, Llama 3; ``CharTokenizer``).

  Args:
    tokenizer: with ``decode(ids) -> str``.
    stop_strings: non-empty strings.
    start: index in the slot's token list where the turn starts.
  """

  MAX_WINDOW = 32

  def __init__(self, tokenizer, stop_strings, start: int):
    self.tokenizer, self.stop_strings = tokenizer, tuple(stop_strings)
    self.keep = max(len(x) for x in self.stop_strings)
    self.start = self.prefix = self.read = start
    self.prefix_chars = 0
    self.tail = ""

  def ends(self, tokens: list) -> bool:
    """``tokens``: the slot's whole token list, its last entry the newest sampled token. Returns
    True when the decoded turn now ends with a stop string."""
    text = self.tokenizer.decode(tokens[self.prefix:])
    if len(text) <= self.prefix_chars or (text.endswith("\ufffd")
                                          and len(tokens) - self.prefix < self.MAX_WINDOW):
      return False  # nothing new, or an unfinished character: the full decode ends in U+FFFD
    self.tail = (self.tail + text[self.prefix_chars:])[-self.keep:]
    self.prefix, self.read = self.read, len(tokens)
    self.prefix_chars = len(self.tokenizer.decode(tokens[self.prefix:self.read]))
    return any(self.tail.endswith(x) for x in self.stop_strings)


@dataclasses.dataclass
class _PendingEnv:
  """A slot whose turn ended and whose ``env.step`` runs on the pool (``env_workers > 0``)."""
  future: concurrent.futures.Future
  token: int         # the token that ended the turn (sampled, not yet in the KV cache)
  ended: bool        # by a stop token / stop string (False: a length limit)
  by_string: bool    # by a stop string
  prefix: object     # the slot's KV cache set aside when the turn ended (engine Prefix), or
                     # None: it stays in the decode state (SAOEngine)


@dataclasses.dataclass
class _Call:
  """A dispatched decode call (``RolloutWorker._dispatch``) whose tokens the host has not read.

  tokens / logprobs: int32 / float32 [slots, decode_steps] (device arrays until read); decoding:
  the slots that decoded their turn in it; epochs: every slot's epoch at dispatch."""
  tokens: object
  logprobs: object
  decoding: list
  epochs: tuple


@dataclasses.dataclass
class WorkerStats:
  """Counters of one worker (seconds are wall-clock, cumulative).

  generate_s / prefill_s: time in the engine's generate / prefill calls (the engine is busy);
  env_s: time inside ``env.step`` (summed over pool threads when ``env_workers > 0``, so it can
  exceed the wall time); idle_s: slept because nothing could be admitted (grpo_sync barrier,
  admission control); env_wait_s: waited because every running slot awaited its ``env.step``;
  sink_s: blocked handing finished trajectories to the sink (a full queue: backpressure);
  decode_slot_steps / env_slot_steps: summed over generate steps, slots decoding / slots waiting on
  their env (slot occupancy = decode_slot_steps / (generate_steps * slots); the decode step
  computes every slot, so the rest, plus ``tokens_discarded``, is idle work);
  prefill_calls: engine prefill calls (one per batch of prompts / observations with
  ``SAOEngine``); overlapped_calls: decode calls dispatched while the previous call's tokens were
  not yet read (``overlap_host``; generate_s then counts the dispatch and the wait for the
  tokens, not the device time hidden behind the host's work)."""
  generate_steps: int = 0
  generate_s: float = 0.0
  prefill_s: float = 0.0
  env_s: float = 0.0
  idle_s: float = 0.0
  env_wait_s: float = 0.0
  sink_s: float = 0.0
  decode_slot_steps: int = 0
  env_slot_steps: int = 0
  tokens_sampled: int = 0
  trajectories: int = 0
  env_errors: int = 0
  weight_updates: int = 0
  kv_recomputes: int = 0
  admission_waits: int = 0
  tokens_discarded: int = 0  # decoded past a turn's end within a generate_steps call
  prefill_calls: int = 0
  overlapped_calls: int = 0


class RolloutWorker:
  """Continuous-batching rollout loop over one engine.

  Args:
    engine: a ``SAOEngine``.
    env: environment with ``prompt_ids(problem)`` and ``step(problem, turn, action_ids)``.
    problems: iterator of problems or ledger ``Handout``s (whose position is recorded in
      ``Trajectory.prompt_position``); the worker stops admitting when it is exhausted. It may
      yield None to mean "nothing to admit right now" (``rollout.source.GatedProblems``).
    sink: called with each finished ``Trajectory``; returns False to ask the worker to stop.
    weights: ``WeightStore`` the trainer publishes to.
    stop_ids: token ids that end a turn (e.g. eos and ``</tool>``).
    max_new_tokens: per-turn cap on sampled tokens.
    max_seq_len: cap on prompt + response length (the model's ``max_seq_len``).
    temperature: sampling temperature (None: the engine's).
    kv_on_update: "keep" (stale KV) or "recompute" (re-prefill running slots with new weights).
    stop_strings: strings that end a turn like a stop token (matched on the decoded turn).
    max_turns: cap on policy turns per trajectory (None: the env's own limit).
    admission: optional shared ``AdmissionControl`` (staleness admission rule).
    env_workers: 0 = call ``env.step`` inline (blocks every slot); N > 0 = run it on N threads
      while the other slots keep decoding (module doc).
    decode_steps: tokens per slot per engine call (``engine.generate_steps``): the host reads
      the tokens, checks stops and routes turns once per call. A slot whose turn ends part-way
      discards the rest of the call's tokens for it (``stats.tokens_discarded``); weights are
      picked up between calls. 1 = one token per call.
    overlap_host: dispatch the next decode call before reading the previous one's tokens
      (module doc; ``SAOEngine`` only). False = read each call's tokens before the next.

  Raises ValueError for an unknown ``kv_on_update``, ``env_workers < 0``, ``decode_steps < 1``,
  an empty stop string, or ``overlap_host`` with an engine that has only the JetStream API.
  """

  def __init__(self, engine: SAOEngine, env, problems: Iterator, sink: Callable[[Trajectory], bool],
               weights: WeightStore, *, stop_ids, max_new_tokens: int, max_seq_len: int,
               temperature: Optional[float] = None, seed: int = 0, kv_on_update: str = "keep",
               stop_strings=(), max_turns: Optional[int] = None,
               admission: Optional[AdmissionControl] = None, env_workers: int = 0,
               decode_steps: int = 1, overlap_host: bool = False):
    if kv_on_update not in ("keep", "recompute"):
      raise ValueError(f"rollout.kv_on_update={kv_on_update!r}; use 'keep' or 'recompute'.")
    if env_workers < 0:
      raise ValueError(f"env_workers={env_workers} must be >= 0 (0 = inline env.step).")
    if decode_steps < 1:
      raise ValueError(f"rollout.decode_steps={decode_steps} must be >= 1 (tokens per engine "
                       "call; 1 = one step per call).")
    self.decode_steps = int(decode_steps)
    # SAOEngine's batched calls; any other JetStream-API engine (prefill / insert / generate /
    # slot_prefix) runs one token per call
    self._batched = all(hasattr(engine, a) for a in ("prefill_insert", "generate_steps"))
    if not self._batched and self.decode_steps != 1:
      raise ValueError(f"rollout.decode_steps={decode_steps} needs an engine with generate_steps "
                       f"(SAOEngine); {type(engine).__name__} has only the JetStream API: use 1.")
    self.overlap_host = bool(overlap_host)
    if not self._batched and self.overlap_host:
      raise ValueError(f"rollout.overlap_host=True needs an engine with generate_steps (SAOEngine);"
                       f" {type(engine).__name__} has only the JetStream API: use False.")
    self.kv_on_update = kv_on_update
    self.stop_strings = tuple(stop_strings)
    if any(not isinstance(x, str) or not x for x in self.stop_strings):
      raise ValueError(f"stop_strings={self.stop_strings!r}: each must be a non-empty string.")
    self.max_turns = max_turns
    self.admission = admission
    self.engine, self.env, self.problems, self.sink = engine, env, problems, sink
    self.weights = weights
    self.stop_ids = frozenset(int(i) for i in stop_ids)
    self.max_new_tokens = max_new_tokens
    self.max_seq_len = min(max_seq_len, engine.cfg.max_seq_len)
    self.temperature = temperature
    self.params, self.version = weights.latest()
    self.state = engine.init_decode_state(seed)
    self.slots: list[Optional[_Slot]] = [None] * engine.max_concurrent_decodes
    self.exhausted = False
    self.waiting = False  # the problem source returned None (nothing to admit right now)
    self.stats = WorkerStats()
    self.error: Optional[BaseException] = None
    self._env_pool = (concurrent.futures.ThreadPoolExecutor(env_workers,
                                                            thread_name_prefix="env-step")
                      if env_workers > 0 else None)
    self._pending: dict[int, _PendingEnv] = {}  # slot -> its env.step in flight
    # (slot, [pending token] + observation, start): answered turns awaiting one batched prefill
    self._observations: list[tuple[int, list, int]] = []
    self._stats_lock = threading.Lock()
    self._sink_since: Optional[float] = None  # perf_counter when a sink call (queue.put) began
    # per slot, bumped by every host-side change (turn end, admission, prefill, free): a decode
    # call's tokens for a slot count only while its epoch is the one captured at dispatch
    self._epoch = [0] * len(self.slots)
    self._inflight: Optional[_Call] = None  # overlap_host: the call dispatched, not yet read

  # ---- helpers ----------------------------------------------------------------------------------
  def _prefill(self, ids, prefix=None):
    padded, n = self.engine.pad_to_bucket(ids)
    t0 = time.perf_counter()
    out = self.engine.prefill(params=self.params, existing_prefix=prefix, padded_tokens=padded,
                              true_length=n, temperature=self.temperature)
    self.stats.prefill_s += time.perf_counter() - t0
    self.stats.prefill_calls += 1
    return out

  def _prefill_insert(self, slots, chunks, starts=None):
    """``engine.prefill_insert`` of every chunk in one call, on the current params, timed into
    ``stats.prefill_s``; returns the sampled tokens and log-probs as lists. Rows are padded to
    the engine's default, the next power of two (at most all slots): a few row counts compile
    (1, 2, 4, ... slots, each per prompt-length bucket, for fresh prompts and for appended
    chunks), and padding at most doubles the prefill compute."""
    t0 = time.perf_counter()
    self.state, tokens, logprobs = self.engine.prefill_insert(
        self.params, self.state, slots, chunks, temperature=self.temperature, starts=starts)
    self.stats.prefill_s += time.perf_counter() - t0
    self.stats.prefill_calls += 1
    return tokens.tolist(), logprobs.tolist()

  def _next_slot(self) -> Optional[_Slot]:
    """The next problem as a fresh ``_Slot`` (not yet prefilled), or None when admission control
    says wait, the source has nothing right now, or it is exhausted."""
    if self.admission is not None and not self.admission.try_start(self.version):
      self.stats.admission_waits += 1
      return None
    try:
      problem = next(self.problems)
    except StopIteration:
      self.exhausted = True
      if self.admission is not None:
        self.admission.finish(accepted=False)
      return None
    if problem is None:  # a gated source has nothing to hand out now (grpo_sync barrier)
      self.waiting = True
      return None
    position = -1
    if isinstance(problem, Handout):  # from the prompt ledger: the position travels along
      problem, position = problem.problem, problem.position
    begin = getattr(self.env, "begin_episode", None)
    if begin is not None:  # an env with per-episode state (envs/workspace.py): its own handle
      problem = begin(problem)
    prompt = list(self.env.prompt_ids(problem))
    if len(prompt) >= self.max_seq_len:
      raise ValueError(f"prompt of {len(prompt)} tokens for problem {getattr(problem, 'id', '?')} "
                       f"does not fit model.max_seq_len={self.max_seq_len}; raise it.")
    n = len(prompt)
    return _Slot(problem, prompt, [0.0] * n, [0.0] * n, [-1] * n, turn_start=n,
                 t_start=time.time(), position=position)

  def _admit_free_slots(self) -> int:
    """Fills every free slot it can with a new prompt on the newest weights, then records each
    first token. Returns the number admitted. All prompts admitted together go in one
    ``engine.prefill_insert`` (``_prefill_insert``); a first token that ends its turn queues
    its observation, prefilled before this returns (``_prefill_observations``). Other
    JetStream engines: ``prefill`` + ``insert`` per prompt."""
    self._sync_weights()  # new prompts start on the newest weights
    admitted = []
    for i in range(len(self.slots)):
      if self.slots[i] is not None or self.exhausted or self.waiting:
        continue
      slot = self._next_slot()
      if slot is None:
        break
      admitted.append((i, slot))
    if not admitted:
      return 0
    if self._batched:
      tokens, logprobs = self._prefill_insert([i for i, _ in admitted],
                                              [s.tokens for _, s in admitted])
    else:
      tokens, logprobs = [], []
      for i, slot in admitted:
        prefix = self._prefill(slot.tokens)
        self.state = self.engine.insert(prefix, self.state, i)
        tokens.append(int(prefix.token))
        logprobs.append(float(prefix.logprob))
    for (i, slot), token, logprob in zip(admitted, tokens, logprobs):
      self.slots[i] = slot
      self._epoch[i] += 1
      self._on_token(i, int(token), float(logprob))
    self._prefill_observations()
    return len(admitted)

  def _on_token(self, i: int, token: int, logprob: float) -> bool:
    """Records a sampled token for slot i; ends the turn when due (may recurse via prefill).
    Returns True when the slot goes on decoding the same turn (its next token in a
    ``generate_steps`` call is valid), False when the turn ended here."""
    s = self.slots[i]
    s.tokens.append(token)
    s.action_mask.append(1.0)
    s.logprobs.append(logprob)
    s.versions.append(self.version)
    self.stats.tokens_sampled += 1
    turn_len = len(s.tokens) - s.turn_start
    ended = token in self.stop_ids
    by_string = False
    if not ended and self.stop_strings:
      if s.text is None or s.text.start != s.turn_start:  # a new turn
        s.text = TurnText(self.engine.tokenizer, self.stop_strings, s.turn_start)
      by_string = ended = s.text.ends(s.tokens)
    if not (ended or turn_len >= self.max_new_tokens or len(s.tokens) >= self.max_seq_len):
      return True
    self._epoch[i] += 1  # tokens of a decode call already dispatched are past the turn's end
    if self._env_pool is not None:  # off the decode loop: the other slots keep decoding
      # SAOEngine: the slot's cache stays in the decode state (idle decoding writes only past its
      # true length, which the observation's prefill overwrites); others: set it aside
      aside = None if self._batched else self.engine.slot_prefix(self.state, i)
      self._pending[i] = _PendingEnv(
          self._env_pool.submit(self._env_step, s.problem, s.turn, s.tokens[s.turn_start:]),
          token, ended, by_string, aside)
      return False
    try:
      step = self._env_step(s.problem, s.turn, s.tokens[s.turn_start:])
    except Exception as e:  # a failing env/reward must not kill the run: record and go on
      self._env_failed(i, e)
      return False
    self._after_env(i, step, token, ended, by_string)
    return False

  def _env_step(self, problem, turn, action):
    t0 = time.perf_counter()
    try:
      return self.env.step(problem, turn, action)
    finally:
      with self._stats_lock:
        self.stats.env_s += time.perf_counter() - t0

  def _env_failed(self, i: int, e: BaseException) -> None:
    """Records slot i's failed env.step as a failed trajectory (call inside ``except``)."""
    self.stats.env_errors += 1
    self._finish(i, 0.0, truncated=False,
                 info={"failed": True, "error": f"{type(e).__name__}: {e}",
                       "traceback": traceback.format_exc(limit=3)})

  def _collect_env(self, block: bool) -> None:
    """Feeds every finished pooled ``env.step`` back to its slot, in slot order. ``block``: first
    wait (up to 50 ms) for at least one to finish -- the engine has nothing else to do."""
    if not self._pending:
      return
    if block:
      t0 = time.perf_counter()
      concurrent.futures.wait([p.future for p in self._pending.values()], timeout=0.05,
                              return_when=concurrent.futures.FIRST_COMPLETED)
      self.stats.env_wait_s += time.perf_counter() - t0
    for i in sorted(self._pending):
      p = self._pending[i]
      if not p.future.done():
        continue
      del self._pending[i]
      try:
        step = p.future.result()
      except Exception as e:  # pylint: disable=broad-except  (as inline: a failed trajectory)
        self._env_failed(i, e)
        continue
      self._after_env(i, step, p.token, p.ended, p.by_string, p.prefix)
    self._prefill_observations()

  def _after_env(self, i: int, step, token: int, ended: bool, by_string: bool,
                 prefix=None) -> None:
    """Slot i's env answered its turn: finish the trajectory or continue with the observation
    prefilled onto the slot's KV cache (``prefix``: the cache set aside when the turn ended;
    None = the slot's cache in the decode state)."""
    s = self.slots[i]
    s.turn += 1
    s.tool_calls += int(step.info.get("tool_calls", 0))
    obs = list(step.observation_ids)
    if step.done or not ended:
      truncated = (not ended) or bool(step.info.get("truncated", False))
      if not ended:
        reason = "max_length" if len(s.tokens) >= self.max_seq_len else "max_new_tokens"
      elif by_string:
        reason = "stop_string"
      elif token == getattr(self.engine.tokenizer, "eos_id", None):
        reason = "eos"
      else:
        reason = "max_turns" if s.turn >= getattr(self.env, "max_turns", s.turn + 1) else "done"
      self._finish(i, float(step.reward), truncated=truncated,
                   info=dict(step.info, finish_reason=reason))
      return
    if self.max_turns is not None and s.turn >= self.max_turns:
      self._finish(i, 0.0, truncated=True,
                   info=dict(step.info, truncated=True, finish_reason="max_turns"))
      return
    if (len(s.tokens) + len(obs) + 1 > self.max_seq_len
        or len(obs) + 1 > self.engine.max_prefill_length):
      self._finish(i, 0.0, truncated=True,
                   info=dict(step.info, truncated=True, finish_reason="max_length"))
      return
    # Observation: append to the slot's KV cache after the stop token (not yet cached).
    s.tokens.extend(obs)
    s.action_mask.extend([0.0] * len(obs))
    s.logprobs.extend([0.0] * len(obs))
    s.versions.extend([-1] * len(obs))
    s.turn_start = len(s.tokens)
    if prefix is None and self._batched:  # in place: [token] + obs after the cached tokens
      self._observations.append((i, [token] + obs, len(s.tokens) - len(obs) - 1))
      return  # prefilled with the other slots' (_prefill_observations)
    if prefix is None:
      prefix = self.engine.slot_prefix(self.state, i)
    prefix = self._prefill([token] + obs, prefix=prefix)
    self.state = self.engine.insert(prefix, self.state, i)
    self._on_token(i, int(prefix.token), float(prefix.logprob))

  def _prefill_observations(self) -> None:
    """Prefills every queued observation (``SAOEngine``: each slot's pending token + its
    observation, after the slot's cached tokens) in one ``prefill_insert`` and records each
    slot's first token; a first token that ends its turn again (an inline env) queues a next
    round. Called after each phase of ``step`` that can end turns, so no queued slot is ever
    decoded or re-prefilled (``_recompute_kv``) before its observation is cached."""
    while self._observations:
      queue, self._observations = self._observations, []
      tokens, logprobs = self._prefill_insert([i for i, _, _ in queue], [c for _, c, _ in queue],
                                              starts=[start for _, _, start in queue])
      for (i, _, _), token, logprob in zip(queue, tokens, logprobs):
        self._epoch[i] += 1
        self._on_token(i, int(token), float(logprob))

  def _finish(self, i: int, reward: float, truncated: bool, info: dict) -> None:
    s = self.slots[i]
    self.slots[i] = None
    self._epoch[i] += 1
    end = getattr(self.env, "end_episode", None)
    if end is not None:  # frees the episode's state (a workspace folder)
      end(s.problem)
    info = dict(info, tool_calls=s.tool_calls)  # summed over the episode's turns
    traj = Trajectory(
        problem_id=str(getattr(s.problem, "id", "")),
        tokens=np.asarray(s.tokens, np.int32), action_mask=np.asarray(s.action_mask, np.float32),
        logprobs=np.asarray(s.logprobs, np.float32),
        policy_version=np.asarray(s.versions, np.int32), reward=reward, num_turns=s.turn,
        truncated=truncated, info=info, t_start=s.t_start, t_end=time.time(),
        prompt_position=s.position)
    self.stats.trajectories += 1
    if self.admission is not None:
      self.admission.finish(accepted=not info.get("failed", False))
    with self._stats_lock:
      self._sink_since = time.perf_counter()
    accepted = self.sink(traj)
    with self._stats_lock:
      self.stats.sink_s += time.perf_counter() - self._sink_since
      self._sink_since = None
    if not accepted:
      self.exhausted = True

  def sink_s_now(self) -> float:
    """``stats.sink_s`` plus the sink call in progress, if any (a full queue can block the
    worker for many seconds; this counts that time when it is spent, not when it ends)."""
    with self._stats_lock:
      since = self._sink_since
      return self.stats.sink_s + (time.perf_counter() - since if since is not None else 0.0)

  def _recompute_kv(self) -> None:
    """Re-prefills every running slot's cached tokens with the current params (the pending,
    not yet cached token and its recorded log-prob are kept)."""
    chunk = self.engine.max_prefill_length
    for i, s in enumerate(self.slots):
      if s is None:
        continue
      cached, prefix = s.tokens[:-1], None
      for start in range(0, len(cached), chunk):
        prefix = self._prefill(cached[start:start + chunk], prefix=prefix)
      prefix = prefix.replace(token=np.int32(s.tokens[-1]), logprob=np.float32(s.logprobs[-1]))
      if i in self._pending and not self._batched:  # env answering: continue from this cache
        self._pending[i].prefix = prefix
      else:
        self.state = self.engine.insert(prefix, self.state, i)
      self.stats.kv_recomputes += 1

  def _sync_weights(self) -> None:
    """Picks up the newest published weights (between generate steps / before a new prompt)."""
    newer = self.weights.latest_if_newer(self.version)
    if newer is not None:
      if self._inflight is not None:  # its tokens were sampled by the weights in use: read first
        call, self._inflight = self._inflight, None
        self._read(call)
      self.params, self.version = newer
      self.stats.weight_updates += 1
      if self.kv_on_update == "recompute":
        self._recompute_kv()

  # ---- loop -------------------------------------------------------------------------------------
  def step(self) -> bool:
    """One iteration. Returns False when there is nothing left to do."""
    self._sync_weights()
    self._collect_env(block=False)
    self.waiting = False
    while None in self.slots and not self.exhausted and not self.waiting:
      if not self._admit_free_slots():  # again: a first token can end a turn and free its slot
        break
    decoding = [i for i, s in enumerate(self.slots) if s is not None and i not in self._pending]
    if not decoding:
      if self._inflight is not None:  # overlap: its tokens can end turns and free slots
        call, self._inflight = self._inflight, None
        self._read(call)
        return True
      if self._pending:  # every running slot waits on its env.step
        self._collect_env(block=True)
        return True
      if not self.exhausted:  # gated source or admission control said wait: do not spin
        time.sleep(0.002)
        self.stats.idle_s += 0.002
      return not self.exhausted
    call = self._dispatch(decoding)
    if not self.overlap_host:
      self._read(call)
      return True
    previous, self._inflight = self._inflight, call
    if previous is not None:  # call N+1 decodes while the host routes call N's tokens
      self.stats.overlapped_calls += 1
      self._read(previous)
    return True

  def _dispatch(self, decoding: list) -> _Call:
    """Runs one decode call (``decode_steps`` steps) for every slot on the current params;
    ``decoding``: the slots decoding their turn. With ``overlap_host`` it returns once the call
    is dispatched, its tokens still on the device."""
    t0 = time.perf_counter()
    n = self.decode_steps
    if self._batched:
      kwargs = {"to_host": False} if self.overlap_host else {}
      self.state, tokens, logprobs = self.engine.generate_steps(self.params, self.state, n,
                                                                self.temperature, **kwargs)
    else:
      self.state, result = self.engine.generate(self.params, self.state, self.temperature)
      tokens, logprobs = np.asarray(result.data)[:, :1], np.asarray(result.logprobs)[:, :1]
    self.stats.generate_s += time.perf_counter() - t0
    self.stats.generate_steps += n
    self.stats.decode_slot_steps += n * len(decoding)
    self.stats.env_slot_steps += n * len(self._pending)
    return _Call(tokens, logprobs, decoding, tuple(self._epoch))

  def _read(self, call: _Call) -> None:
    """Reads ``call``'s tokens on the host (waiting for the device) and routes each decoding
    slot's to its trajectory, up to the end of its turn; a slot whose epoch moved since the
    dispatch has all of them discarded. Then prefills the observations of the turns answered."""
    t0 = time.perf_counter()
    tokens, logprobs = np.asarray(call.tokens), np.asarray(call.logprobs)
    self.stats.generate_s += time.perf_counter() - t0
    n = tokens.shape[1]
    for i in call.decoding:
      if self._epoch[i] != call.epochs[i]:  # changed on the host after the dispatch (overlap)
        self.stats.tokens_discarded += n
        continue
      for j in range(n):
        if not self._on_token(i, int(tokens[i, j]), float(logprobs[i, j])):
          self.stats.tokens_discarded += n - 1 - j
          break
    self._prefill_observations()

  def run(self, stop: Optional[threading.Event] = None) -> None:
    """Loops until the problems are exhausted and every slot drained, or ``stop`` is set."""
    try:
      while not (stop is not None and stop.is_set()):
        if not self.step():
          break
    except BaseException as e:  # surfaced to the trainer, which reports and stops
      self.error = e
      raise
    finally:
      self.close()

  def close(self) -> None:
    """Stops the env-step pool (in-flight steps are abandoned; their threads end on their own)
    and drops an unread decode call (``overlap_host``: its slots' trajectories are abandoned
    with the run, as without overlap)."""
    self._inflight = None
    if self._env_pool is not None:
      self._env_pool.shutdown(wait=False, cancel_futures=True)

  def start_thread(self, stop: threading.Event) -> threading.Thread:
    t = threading.Thread(target=self.run, args=(stop,), name="rollout-worker", daemon=True)
    t.start()
    return t


def env_workers_for(config) -> int:
  """``config``: the run's ``roles.Run``. Resolves ``rollout.env_workers``: N >= 0 as given;
  -1 (auto) = ``rollout.slots`` when the task's tool is slow (``task.tool_latency_median_s`` >
  0, or the sandboxed Python of ``tir_math``), else 0 (inline)."""
  n = int(config.rollout.env_workers)
  if n >= 0:
    return n
  slow = config.task.tool_latency_median_s > 0 or config.task.name == "tir_math"
  return int(config.rollout.slots) if slow else 0


def generate_trajectories(engine: SAOEngine, env, params, problems, *, stop_ids,
                          max_new_tokens: int, max_seq_len: int, temperature: float,
                          version: int = 0, seed: int = 0, stop_strings=(),
                          env_workers: int = 0, decode_steps: int = 1,
                          overlap_host: bool = False) -> list[Trajectory]:
  """Synchronously rolls out every problem once (e.g. greedy evaluation, temperature=0);
  ``decode_steps``, ``overlap_host``: ``RolloutWorker``'s.

  Returns the trajectories in the order of ``problems``."""
  out: list[Trajectory] = []
  worker = RolloutWorker(engine, env, iter(problems), lambda t: out.append(t) or True,
                         WeightStore(params, version), stop_ids=stop_ids,
                         max_new_tokens=max_new_tokens, max_seq_len=max_seq_len,
                         temperature=temperature, seed=seed, stop_strings=stop_strings,
                         env_workers=env_workers, decode_steps=decode_steps,
                         overlap_host=overlap_host)
  worker.run()
  order = {getattr(p, "id", i): i for i, p in enumerate(problems)}
  return sorted(out, key=lambda t: order.get(t.problem_id, 0))

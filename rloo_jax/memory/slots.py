"""The rollout engine's slot pool sized to the device: `memory.advice`'s config.rloo.rollout_slots.

The engine (`rloo_jax.engine`) holds a KV buffer of max_new_tokens for each of its `slots`
streams and a pool of prompt rows (by default 2 * slots / k of them), so its cache scales with
the slots. When the engine's program does not fit, the slots that would are guessed from the
cache bytes per slot, rounded down to a multiple of k (a group's k streams are admitted
together), and compiled to check; a miss is refitted (the peak affine in the slots, through the
two smallest compiled) and compiled again, at most three compiles in all. When the static
sampler's rollout does not fit, the engine is the option: its slots guessed from the static
cache's bytes per stream (its buffer and its share of its prompt's), and compiled the same way.
"""

from __future__ import annotations

from rloo_jax.memory import programs as programs_lib

GIB = 2 ** 30
_COMPILES = 3  # at most, for one suggestion


def _size(n: float) -> str:
  return f"{n / GIB:.3g} GiB"


def _affine(seen: dict, limit: int, at: int):
  """The slots at which the peak, affine in the slots through the two compiles nearest `at`,
  reaches `limit` (None when it does not grow with them)."""
  (a, peak_a), (b, peak_b) = sorted(seen.items(), key=lambda item: abs(item[0] - at))[:2]
  slope = (peak_b - peak_a) / (b - a)
  return a + (limit - peak_a) / slope if slope > 0 else None


def fit(peak_at, known: dict, guess: float, k: int, top: int, limit: int):
  """(slots, peak): a multiple of k in [k, top] whose compiled peak (`peak_at(slots)`) is within
  `limit`; `known`: {slots: peak} compiled already. Of at most _COMPILES, from `guess`: after a
  miss the affine fit's pick below it (halving with no fit yet), after a fit the fit's pick
  above it (doubling with no fit yet) while it fits. None when none tried fits."""
  seen, best = dict(known), None
  s = guess
  for _ in range(_COMPILES):
    s = None if s is None else min(top, int(s + 1e-6) // k * k)
    if s is None or s < k or s in seen:
      break
    seen[s] = peak_at(s)
    if seen[s] <= limit:
      best = (s, seen[s])
      s = 2 * s if len(seen) < 2 else _affine(seen, limit, s)
    elif best is not None:
      break
    else:  # halved where the peak does not grow with the slots (the at-once engine's layout)
      s = (_affine(seen, limit, s) if len(seen) > 1 else None) or s // 2
  return best


def advice(algo, compiled, limit: int, over: dict, accelerator: bool) -> list:
  """[(bytes, text)]: the rollout_slots (and, when set above them, rollout_prefix_rows) whose
  engine program fits `limit` bytes, compiled; `over`: {program: bytes over the limit}. Empty
  when even an engine of no cache would not fit (what stays resident and the weights)."""
  exp = algo.exp
  c, k = exp.config, int(exp.config.rloo.k)
  r = exp.rollout_shape
  ways, slots, rows = r.ways, r.slots, r.prefix_rows
  cache, programs = compiled.kv_cache_bytes, compiled.programs
  rollout = [n for n in ("engine", "start", "decode") if n in over]
  if not rollout or not cache or c.rloo.sampler_mode != "shared":
    return []  # the engine shares each prompt's prefill: 'shared' mode only
  need = max(over[n] for n in rollout)
  # The least any engine holds: what stays resident beside it, and the policy's weights.
  policy = compiled.state_bytes["params"] + (
      compiled.state_bytes["ref_params"] if exp.model_config.lora_rank else 0)
  if min(programs[n].resident for n in rollout) + policy >= limit:
    return []
  if slots:
    streams, known, hoisted = slots, {slots: programs["engine"].peak}, programs["engine"].hoisted
  else:
    streams, known = r.chunk * k, {}
    hoisted = max(programs[n].hoisted for n in ("start", "decode") if n in programs)
  explicit_rows = int(c.rloo.get("rollout_prefix_rows", 0) or 0)

  def config_at(s):
    config = c.copy_and_resolve_references()
    config.rloo.rollout_slots = s
    if explicit_rows > s:
      config.rloo.rollout_prefix_rows = s
    return config

  def peak_at(s):
    return programs_lib.compile_at(algo, config_at(s), ("engine",),
                                   accelerator=accelerator)["engine"].peak + hoisted

  step = k * ways  # every batch shard's engine holds whole groups
  guess = max(step, streams * (cache - need) / cache)  # the cache alone shrunk by `need`
  found = fit(peak_at, known, guess, step, streams - step, limit)
  if found is None:
    return []
  s, peak = found
  setting = f"--config.rloo.rollout_slots={s}" + (
      f" --config.rloo.rollout_prefix_rows={s}" if explicit_rows > s else "")
  if slots:
    text = (f"{setting} (now {slots}: the rollout engine's KV cache, {_size(cache)} for "
            f"{slots} stream slots and {rows} prompt rows, shrinks with the slots; compiled "
            f"at {s}: engine peak {_size(peak)})")
  else:
    text = (f"{setting} (the rollout engine: {s} streams decode at once, a slot refilled as "
            f"its stream ends, where the static sampler's KV cache, {_size(cache)}, holds all "
            f"{streams} of a chunk; compiled at {s}: engine peak {_size(peak)})")
  return [(cache, text)]

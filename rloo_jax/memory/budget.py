"""config.train.microbatch_tokens='auto': the largest packed-row budget with which the job fits.

The candidates double from the least budget (one completion at full length with its prompt, a
row) to one that holds every completion of a batch shard's minibatch share in one row; each is
planned (`memory.plan`: every program compiled, the device's memory against its peak) and the
largest that fits is taken, by bisection (the peak grows with the budget), so a job compiles a
few plans at start-up. None fitting: the least, and the preflight (`memory.check`) says what
else to turn.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from rloo_jax import memory, packing


def candidates(config, shards: int) -> list[int]:
  """The budgets tried, smallest first."""
  c = config
  least = packing.min_tokens(c.data.max_prompt_len, c.rloo.max_new_tokens)
  per_shard = -(-c.rloo.num_prompts * c.rloo.k // c.train.num_minibatches // shards)
  out = [least]
  while out[-1] * 2 < per_shard * least:
    out.append(out[-1] * 2)
  return out + [per_shard * least] if per_shard > 1 else out


def with_budget(algo, budget: int):
  """The algorithm object again, its config's budget set (programs not yet compiled)."""
  config = algo.exp.config.copy_and_resolve_references()
  with config.unlocked():  # 'auto' typed the resolved field as a string
    del config.train["microbatch_tokens"]
    config.train.microbatch_tokens = int(budget)
  return type(algo)(dataclasses.replace(algo.exp, config=config))


def resolve(algo, *, device_memory_gb: Optional[float] = None, accelerator: bool = False,
            log=print) -> tuple[object, Optional[dict]]:
  """(`algo` with 'auto' replaced by the largest candidate that fits, that candidate's plan);
  (algo, None) when it is not 'auto'; (the least candidate, None) when none fits.
  device_memory_gb: default, `memory.device_memory_gb` of the mesh."""
  if algo.exp.config.train.get("microbatch_tokens", 0) != "auto":
    return algo, None
  if device_memory_gb is None:
    device_memory_gb = memory.device_memory_gb(algo.exp)
  tried = candidates(algo.exp.config, algo.exp.layout.batch_parallelism)
  lo, hi, best, over = 0, len(tried) - 1, None, []
  while lo <= hi:
    mid = (lo + hi) // 2
    candidate = with_budget(algo, tried[mid])
    # Only whether it fits: the advice for a candidate over the device is not used.
    report = memory.plan(candidate, device_memory_gb=device_memory_gb, accelerator=accelerator,
                         advise=False)
    if report["fits"]:
      best, lo = (candidate, tried[mid], report), mid + 1
    else:
      hi, over = mid - 1, over + [tried[mid]]
  # An accelerator's compiler warns as it fails to rematerialise a candidate under the memory.
  why = (f"; {sorted(over)} did not (any \"Can't reduce memory use below\" warning of XLA "
         "above is theirs)" if over else "")
  if best is None:
    log(f"[plan] config.train.microbatch_tokens='auto': none of {tried} fits "
        f"{device_memory_gb:.2f} GiB; the least, {tried[0]}")
    return with_budget(algo, tried[0]), None
  log(f"[plan] config.train.microbatch_tokens='auto': {best[1]} tokens a packed row (the "
      f"largest of {tried} that fits {device_memory_gb:.2f} GiB: peak "
      f"{best[2]['peak_gb_per_device']:.3g} GiB){why}")
  return best[0], best[2]

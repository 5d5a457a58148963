"""The algorithms the outer loop (`rloo_jax.loop`) runs, by `config.algorithm`:

    rloo   RLOO and every estimator of the advantage registry (grpo, raft, reinforce_ema, vanilla)
    ppo    PPO with a learned critic (GAE, clipped value loss)
    dpo    offline DPO on preference pairs from SFT samples

    from rloo_jax import algorithms
    summary = algorithms.run(config, workdir)
"""

from __future__ import annotations

import os

from rloo_jax import experiment, loop, sharding
from rloo_jax import workdir as workdir_lib
from rloo_jax.algorithms import dpo, ppo
from rloo_jax.algorithms.rloo import RLOO
from rloo_jax.rewards import RewardSet


ALGORITHMS = {"rloo": RLOO, "ppo": ppo.PPO, "dpo": dpo.DPO}
# The algorithms whose config section is completed with defaults and checked by its module.
_SECTIONS = {"ppo": ppo, "dpo": dpo}


def names() -> tuple[str, ...]:
  return tuple(ALGORITHMS)


def resolve(config):
  """(algorithm name, config with its section's defaults), the section checked."""
  name = config.get("algorithm", "rloo")
  if name not in ALGORITHMS:
    raise ValueError(f"unknown config.algorithm {name!r}; choose one of {names()}")
  section = _SECTIONS.get(name)
  if section is not None:
    config = section.with_defaults(config)
    section.validate(config)
  return name, config


def make(config, workdir: str, **build_kw):
  """The algorithm object of `config.algorithm` (default 'rloo'), its experiment built."""
  name, config = resolve(config)
  return ALGORITHMS[name](experiment.build(config, workdir, **build_kw))


def validate(config, *, devices=None, rewards=None, **unused_build_kw) -> None:
  """The checks `make` runs before it prepares data or compiles (the algorithm's name and
  section, the config, its mesh, the reward names), run without touching any workdir: a config
  that cannot train must not become the one a workdir was started with."""
  _, config = resolve(config)
  experiment.validate_config(config)
  layout = sharding.make_layout(config.mesh, devices)
  experiment.validate_layout(config, layout)
  if rewards is None:
    # The build's layout: a Hugging Face reward model loaded here is the one build reuses.
    RewardSet.from_config(config.rewards, layout)


def run(config, workdir: str, *, log=print, **build_kw) -> dict:
  """Builds the configured algorithm and trains it in `workdir` (resuming); the summary.

  Before anything is built, read or written, the config is compared with the one the workdir
  was started with, and the workdir is locked against a second live run."""
  validate(config, **build_kw)
  workdir = os.path.abspath(workdir)
  os.makedirs(workdir, exist_ok=True)
  workdir_lib.check_config(workdir, config, log=log)
  with workdir_lib.Lock(workdir, log=log):
    return loop.run(make(config, workdir, **build_kw), workdir, log=log, check_config=False)

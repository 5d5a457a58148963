"""The algorithms the outer loop (`rloo_jax.loop`) runs, by `config.algorithm`:

    rloo   RLOO and every estimator of the advantage registry (grpo, raft, reinforce_ema, vanilla)
    ppo    PPO with a learned critic (GAE, clipped value loss)
    dpo    offline DPO on preference pairs from SFT samples

    from rloo_jax import algorithms
    summary = algorithms.run(config, workdir)

One run is four steps, each trusting the one before: `validate` (every check on the config,
once, before anything is read, written or compiled), `experiment.build`, the memory preflight
(`algo.preflight`: RLOO's plans the job, `memory.check`), `loop.run`. Each algorithm is an
`base.AlgorithmBase`, which implements the protocol the loop drives (`base.Algorithm`).
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple, Optional

from rloo_jax import experiment, loop, sharding
from rloo_jax import workdir as workdir_lib
from rloo_jax.algorithms import dpo, ppo
from rloo_jax.algorithms.rloo import RLOO
from rloo_jax.models import attention_ops, traced_mesh
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


class Checked(NamedTuple):
  """A config that passed `validate`, with what the checks resolved: what `build` takes."""
  name: str  # config.algorithm
  config: Any  # with the algorithm section's defaults
  layout: sharding.Layout  # the mesh the run is laid over
  rewards: Optional[RewardSet]  # config.rewards resolved (None: not asked for)


def validate(config, *, devices=None, rewards: Optional[RewardSet] = None,
             with_rewards: bool = True) -> Checked:
  """Every check on the config, in one place, run once before anything is built, read or
  written (the algorithm and its section, the config's own consistency, the mesh, the reward
  names; over several processes, that all started alike): a config that cannot train must not
  become the one a workdir was started with. Each failure is one error (a ValueError;
  FileNotFoundError for a missing checkpoint) naming the setting and its fix. Later stages
  trust the result.

  `rewards`: the reward set the caller trains on instead of config.rewards. with_rewards=False:
  config.rewards is left unresolved (the memory plan needs no rewards)."""
  workdir_lib.check_same_config(config)  # multi-process: before one process's own checks stop it
  name, config = resolve(config)
  experiment.validate_config(config)
  layout = sharding.make_layout(config.mesh, devices)
  experiment.validate_layout(config, layout)
  attention_ops.check_platform(config.model.attention, layout.platform,
                               packed=bool(config.train.get("microbatch_tokens", 0)))
  if rewards is None and with_rewards:
    # On the build's layout: a Hugging Face reward model loaded here is the one build uses.
    rewards = RewardSet.from_config(config.rewards, layout)
  return Checked(name, config, layout, rewards)


def build(checked: Checked, workdir: str, *, task=None, eval_rewards=None, log=print):
  """The algorithm object of a validated config, its experiment built."""
  exp = experiment.build(checked.config, workdir, task, layout=checked.layout, log=log,
                         rewards=checked.rewards, eval_rewards=eval_rewards)
  return ALGORITHMS[checked.name](exp)


def make(config, workdir: str, *, devices=None, rewards: Optional[RewardSet] = None, **build_kw):
  """The algorithm object of `config.algorithm` (default 'rloo'): validated, then built."""
  return build(validate(config, devices=devices, rewards=rewards), workdir, **build_kw)


def run(config, workdir: str, *, log=print, devices=None, rewards: Optional[RewardSet] = None,
        **build_kw) -> dict:
  """Trains the configured algorithm in `workdir` (resuming); the summary.

  validate -> (the workdir's config compared, the workdir locked) -> build -> memory preflight
  (`algo.preflight`) -> loop. Nothing is built, read or written before the config passed every
  check and matched the one the workdir was started with."""
  checked = validate(config, devices=devices, rewards=rewards)
  workdir = os.path.abspath(workdir)
  os.makedirs(workdir, exist_ok=True)
  workdir_lib.check_config(workdir, config, log=log)
  with workdir_lib.Lock(workdir, log=log), traced_mesh.on_mesh(checked.layout.mesh):
    algo = build(checked, workdir, log=log, **build_kw)
    log(algo.exp.rollout_shape.line)
    # config.train.check_memory: on an accelerator a job that cannot fit is refused here,
    # before the SFT stage and the first iteration compile anything.
    algo = algo.preflight(log=log)
    return loop.run(algo, workdir, log=log)

"""What the outer loop (`rloo_jax.loop`) needs of an algorithm: the `Algorithm` protocol, and
`AlgorithmBase`, its defaults, which RLOO, PPO and DPO extend.

The loop calls every member below but `preflight` (the step before it: `algorithms.run`, the
RLHF pipeline's RL stage) and probes for none: an algorithm that has nothing to do at a step (no
work before the first iteration, a checkpoint that is the state itself) inherits the default
that does nothing.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

from rloo_jax import experiment as experiment_lib
from rloo_jax import loop, memory


class Batches(Protocol):
  """A checkpointable iterator of an algorithm's batches (prompts, or DPO's pair indices)."""

  num_dropped: int  # records left out (longer than config.data.max_prompt_len)
  num_records: int

  def __next__(self) -> Any: ...

  def get_state(self) -> dict: ...

  def set_state(self, state: dict) -> None: ...


class Algorithm(Protocol):
  """An algorithm as the loop drives it."""

  exp: experiment_lib.Experiment  # the config, task, model, mesh and rewards
  name: str  # 'rloo': summary.json's algorithm, the log's prefix
  label: str  # 'RLOO': the summary table's column

  @property
  def num_iterations(self) -> int: ...  # iterations of a full run

  @property
  def eval_every(self) -> int: ...  # iterations between held-out evaluations (0: none)

  def abstract_state(self) -> Any:
    """The Orbax restore target, shardings included (a checkpoint's form of the state)."""

  def init_state(self, params) -> Any:
    """The state at iteration 0 from the starting policy's params."""

  def resume_state(self, state, base_params: Callable[[], Any]) -> Any:
    """A restored state made whole (LoRA: the base that checkpoints leave out, `base_params()`:
    the starting policy, which the caller loads, and logs, only when it is called)."""

  def checkpoint_state(self, state) -> Any:
    """What of the state a checkpoint holds."""

  def preflight(self, log) -> "Algorithm":
    """Before the loop (config.train.check_memory): the algorithm as it will run on its mesh,
    or an error for a job that cannot fit its devices' memory."""

  def prepare(self, state) -> None:
    """Work that needs the state before the first iteration (DPO's pairs)."""

  def batches(self) -> Batches:
    """The batches `iteration` takes, checkpointable."""

  def iteration(self, state, batch) -> tuple[Any, dict]:
    """One iteration: (state, metrics with update_steps and nonfinite_steps)."""

  def eval_params(self, state) -> tuple[Any, Any]:
    """(policy, reference) as the policy's model functions run them: what evaluations compare."""

  def log_line(self, step: int, metrics: dict) -> str:
    """One line for the log when there is no progress bar."""

  def summary_extra(self) -> dict:
    """More summary.json fields."""


class AlgorithmBase:
  """The protocol's defaults: a run of config.train.num_iterations iterations on the training
  prompts, evaluated every config.train.eval_every, checkpointing its whole state."""

  name = ""
  label = ""

  def __init__(self, exp: experiment_lib.Experiment):
    self.exp = exp

  @property
  def num_iterations(self) -> int:
    return int(self.exp.config.train.num_iterations)

  @property
  def eval_every(self) -> int:
    return int(self.exp.config.train.eval_every)

  def resume_state(self, state, base_params):
    del base_params
    return state

  def checkpoint_state(self, state):
    return state

  def preflight(self, log=print):
    """The memory plan covers the RLOO programs only: on an accelerator mesh this algorithm
    runs unchecked, and `log` says so."""
    if memory.checks(self.exp):
      log(f"[plan] config.train.check_memory: the memory plan covers the RLOO programs only; "
          f"{self.name} is not checked")
    return self

  def prepare(self, state) -> None:
    del state

  def batches(self) -> Batches:
    return loop.prompt_batches(self.exp)

  def eval_params(self, state) -> tuple[Any, Any]:
    return state.params, state.ref_params

  def summary_extra(self) -> dict:
    return {}

"""Orbax checkpoints: the train state (policy, reference, optimizer, rng, step) plus JSON metadata
(the data iterator's position, metrics) saved together, restored into an abstract sharded target.

Sharded and multi-process: every process calls `save` and `restore` together (Orbax writes each
process's shards and coordinates the commit); a checkpoint written on one mesh restores onto any
other, since the restore target (`trainer.abstract_state`) carries the new mesh's shardings.

A newest checkpoint that cannot be read (a run killed mid-write, a truncated file) is reported,
moved aside to `<dir>_corrupt/<step>` (never deleted), and the previous good one is used.
"""

from __future__ import annotations

import os
import shutil
from typing import Any, Optional

from absl import logging
import jax
from jax.experimental import multihost_utils
import orbax.checkpoint as ocp


class Checkpointer:

  def __init__(self, directory: str, *, keep: int = 3, save_every: int = 1):
    self.directory = os.path.abspath(directory)
    self.manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, save_interval_steps=save_every,
                                             create=True))

  def save(self, step: int, state: Any, meta: dict, *, force: bool = False) -> bool:
    saved = self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=force)
    return bool(saved)

  def wait(self):
    self.manager.wait_until_finished()

  def latest_step(self) -> Optional[int]:
    return self.manager.latest_step()

  def restore(self, abstract_state: Any, step: Optional[int] = None):
    """(step, state, meta) of the newest readable checkpoint, or None when there is none.

    `abstract_state` is a pytree of jax.ShapeDtypeStruct carrying the target shardings, so the
    state is restored straight onto the current mesh, whatever mesh wrote it.
    """
    steps = sorted(self.manager.all_steps(), reverse=True)
    if step is not None:
      steps = [s for s in steps if s <= step]
    for s in steps:
      try:
        restored = self.manager.restore(s, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
        return s, restored["state"], restored["meta"]
      except Exception as e:  # pylint: disable=broad-except
        logging.error("checkpoint %d in %s is unreadable (%s: %s); falling back to the previous "
                      "one", s, self.directory, type(e).__name__, e)
        print(f"[checkpoint] step {s} in {self.directory} is unreadable "
              f"({type(e).__name__}: {str(e)[:200]}); using the previous checkpoint")
        self._quarantine(s)
    return None

  def _quarantine(self, step: int):
    """Moves a bad checkpoint out of Orbax's way (so later saves of that step can succeed).

    Process 0 moves it; every process waits for the move before reloading the step list.
    """
    src = os.path.join(self.directory, str(step))
    if jax.process_index() == 0 and os.path.exists(src):
      dst = os.path.join(os.path.dirname(self.directory),
                         os.path.basename(self.directory) + "_corrupt", str(step))
      os.makedirs(os.path.dirname(dst), exist_ok=True)
      if os.path.exists(dst):
        shutil.rmtree(dst)
      shutil.move(src, dst)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"rloo_checkpoint_quarantine_{step}")
    self.manager.reload()

  def close(self):
    self.manager.wait_until_finished()
    self.manager.close()

"""Orbax checkpoints of a train state plus JSON metadata (data iterator position, history).

A checkpoint restores straight onto the current mesh, whatever mesh wrote it: the restore target
(`experiment.abstract_state`) carries the new shardings.

Restore takes the newest *readable* checkpoint. One whose files cannot be read is moved to
`<dir>_corrupt/<step>` (an earlier quarantined copy of that step is kept: the new one gets a
suffix) and the previous one is tried. A readable checkpoint whose tree or shapes differ from
the target is never moved: that is a config or code mismatch, and the error says so.

A run's frozen reference (`state.ref_params`) never changes: the first save writes it once, to
`reference/` beside the checkpoints directory, and every checkpoint holds a scalar in its place;
restore puts it back, and still reads checkpoints written with the reference inside.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from typing import Any, Optional

from absl import logging
import jax
import jax.numpy as jnp
from jax.experimental import multihost_utils
import numpy as np
import orbax.checkpoint as ocp


REFERENCE_DIR = "reference"


class CheckpointMismatchError(ValueError):
  """A readable checkpoint holds another state than the one being restored."""


def _key(k) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def leaf_specs(tree: Any) -> dict[tuple[str, ...], tuple]:
  """{path: (shape, dtype)} of a tree of arrays, ShapeDtypeStructs or Orbax array metadata."""
  return {tuple(_key(k) for k in path): (tuple(leaf.shape), str(leaf.dtype))
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _registry():
  reg = ocp.handlers.DefaultCheckpointHandlerRegistry()
  for name, handler, save, restore in (
      ("state", ocp.StandardCheckpointHandler, ocp.args.StandardSave, ocp.args.StandardRestore),
      ("meta", ocp.JsonCheckpointHandler, ocp.args.JsonSave, ocp.args.JsonRestore)):
    reg.add(name, save, handler)
    reg.add(name, restore, handler)
  return reg


class CheckpointSaveError(OSError):
  """A checkpoint could not be written (a full disk, a read-only or vanished directory)."""


def _disk_error(e: BaseException) -> Optional[OSError]:
  """The OSError behind `e` (orbax may wrap it), if any."""
  while e is not None:
    if isinstance(e, OSError) and not isinstance(e, CheckpointSaveError):
      return e
    e = e.__cause__ or e.__context__
  return None


class Checkpointer:

  def __init__(self, directory: str, *, keep: int = 3, save_every: int = 1):
    if keep < 1:
      raise ValueError(f"keep = {keep}: at least one checkpoint must be kept "
                       "(config.train.keep_checkpoints >= 1)")
    self.directory = os.path.abspath(directory)
    self.reference_dir = os.path.join(os.path.dirname(self.directory), REFERENCE_DIR)
    self._reference_saved = False
    self.manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, save_interval_steps=save_every,
                                             create=True),
        handler_registry=_registry())

  def save(self, step: int, state: Any, meta: dict, *, force: bool = False,
           wait: bool = False) -> bool:
    with self._saving(step):
      if _stores_reference(state) and not self._reference_saved:
        self._save_reference(state.ref_params)
      saved = self.manager.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave(without_reference(state)), meta=ocp.args.JsonSave(meta)),
          force=force)
      if wait:
        self.manager.wait_until_finished()
    return bool(saved)

  def _save_reference(self, ref_params) -> None:
    """Writes reference/ unless it is there (Orbax writes a temporary directory and renames it,
    so a half-written one is never found)."""
    # Every process saves or none does (the save is collective): process 0's view decides.
    if not multihost_utils.broadcast_one_to_all(np.int32(os.path.isdir(self.reference_dir))):
      with ocp.StandardCheckpointer() as c:
        c.save(self.reference_dir, ref_params)
        c.wait_until_finished()
    self._reference_saved = True

  def _restore_reference(self, state, abstract_ref):
    """`state` with the reference its checkpoint left out read back from reference/."""
    if not os.path.isdir(self.reference_dir):
      raise FileNotFoundError(
          f"{os.path.dirname(self.directory)} has checkpoints but no {REFERENCE_DIR}/ (the "
          f"frozen reference they leave out, written at the first save): restore "
          f"{self.reference_dir} from a copy of the workdir, or start again in a new --workdir")
    with ocp.StandardCheckpointer() as c:
      return state.replace(ref_params=c.restore(self.reference_dir, abstract_ref))

  def wait(self):
    with self._saving(None):
      self.manager.wait_until_finished()

  @contextlib.contextmanager
  def _saving(self, step: Optional[int]):
    """An OSError while writing (a full disk: 300 lines of orbax traceback) as one line."""
    try:
      yield
    except Exception as e:  # pylint: disable=broad-except
      err = _disk_error(e)
      if err is None:
        raise
      which = f"checkpoint {step}" if step is not None else "a checkpoint"
      kept = self.all_steps() if os.path.isdir(self.directory) else []
      raise CheckpointSaveError(
          f"writing {which} to {self.directory} failed: {err.strerror or err}; free "
          f"space there or rerun with another --workdir (earlier checkpoints kept: "
          f"{kept or 'none'})") from e

  def latest_step(self) -> Optional[int]:
    return self.manager.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def _check_matches(self, step: int, abstract_state: Any) -> None:
    """Raises CheckpointMismatchError when step's tree differs from the target's; any other
    exception means the checkpoint cannot be read."""
    saved = leaf_specs(self.manager.item_metadata(step)["state"])
    want = leaf_specs(abstract_state)
    if saved == want:
      return
    missing = sorted(set(want) - set(saved))
    extra = sorted(set(saved) - set(want))
    shapes = sorted(k for k in set(want) & set(saved) if want[k] != saved[k])
    lines = [f"  {'/'.join(k)}: {saved[k]} in the checkpoint, {want[k]} wanted"
             for k in shapes[:5]]
    lines += [f"  {'/'.join(k)}: not in the checkpoint" for k in missing[:3]]
    lines += [f"  {'/'.join(k)}: only in the checkpoint" for k in extra[:3]]
    raise CheckpointMismatchError(
        f"checkpoint {step} in {self.directory} holds another model or train state than this "
        f"config builds ({len(shapes)} shapes differ, {len(missing)} missing, {len(extra)} "
        f"extra):\n" + "\n".join(lines) + "\nNothing was moved. Restart with the config that "
        "wrote it, or use a new --workdir.")

  def restore(self, abstract_state: Any, step: Optional[int] = None):
    """(step, state, meta) of the newest readable checkpoint, or None when there is none.

    `abstract_state` is a pytree of jax.ShapeDtypeStruct carrying the target shardings, so the
    state is restored straight onto the current mesh, whatever mesh wrote it.
    """
    steps = sorted(self.manager.all_steps(), reverse=True)
    if step is not None:
      steps = [s for s in steps if s <= step]
    new_form = without_reference(abstract_state)
    for s in steps:
      try:
        target = self._written_form(s, new_form, abstract_state)
        restored = self.manager.restore(s, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
      except CheckpointMismatchError:
        raise
      except Exception as e:  # pylint: disable=broad-except
        logging.error("checkpoint %d in %s is unreadable (%s: %s); falling back to the previous "
                      "one", s, self.directory, type(e).__name__, e)
        print(f"[checkpoint] step {s} in {self.directory} is unreadable "
              f"({type(e).__name__}: {str(e)[:200]}); using the previous checkpoint")
        self._quarantine(s)
        continue
      state = restored["state"]
      if target is not abstract_state:  # outside the try: no reference is no corrupt checkpoint
        state = self._restore_reference(state, abstract_state.ref_params)
      return s, state, restored["meta"]
    return None

  def _written_form(self, step: int, new_form, old_form):
    """The form checkpoint `step` was written in: today's, without the reference, or the one
    before the reference moved out of the checkpoints. Today's mismatch error if neither."""
    try:
      self._check_matches(step, new_form)
      return new_form
    except CheckpointMismatchError as e:
      if new_form is old_form:
        raise
      try:
        self._check_matches(step, old_form)
      except CheckpointMismatchError:
        raise e from None
      return old_form

  def _quarantine(self, step: int):
    """Moves a bad checkpoint out of Orbax's way (so later saves of that step can succeed),
    keeping any copy quarantined before. Process 0 moves it; every process waits for the move
    before reloading the step list."""
    src = os.path.join(self.directory, str(step))
    if jax.process_index() == 0 and os.path.exists(src):
      parent = os.path.join(os.path.dirname(self.directory),
                            os.path.basename(self.directory) + "_corrupt")
      dst, n = os.path.join(parent, str(step)), 1
      while os.path.exists(dst):
        dst, n = os.path.join(parent, f"{step}.{n}"), n + 1
      os.makedirs(parent, exist_ok=True)
      shutil.move(src, dst)
      print(f"[checkpoint] moved the unreadable step {step} to {dst}")
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"rloo_checkpoint_quarantine_{step}")
    self.manager.reload()

  def close(self):
    self.manager.wait_until_finished()
    self.manager.close()


def _stores_reference(state) -> bool:
  """A state whose frozen reference lives in <workdir>/reference (LoRA's base is rebuilt from
  its source instead: rloo_jax.adapters)."""
  return hasattr(state, "ref_params") and not getattr(state, "lora", False)


def without_reference(state):
  """The state as a checkpoint holds it: a scalar in place of the frozen reference."""
  if not _stores_reference(state):
    return state
  # Placed as the step is (a global array, which a multi-process save needs); zeros_like keeps
  # its sharding and is one cached program, where a new jit each save traced and lowered anew.
  placeholder = (jax.ShapeDtypeStruct((), jnp.int8, sharding=state.step.sharding)
                 if isinstance(state.step, jax.ShapeDtypeStruct)
                 else jnp.zeros_like(state.step, dtype=jnp.int8))
  return state.replace(ref_params=placeholder)

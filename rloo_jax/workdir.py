"""What a workdir knows about the run that owns it: the resolved config and library versions it
started with (`run_config.json`), and a lock that keeps a second live run out.

A restart whose config differs from the saved one stops with an error listing the differing
keys, before anything is read, moved or written, unless every difference is in `RESUMABLE_KEYS`
(settings that only say how long to run, how often to log, evaluate and save, and how the same
computation is laid out in memory: microbatches, rematerialisation, chunk sizes). A key the saved
config lacks (a run started before the key existed) matches its base_config default, which every
new key keeps equal to the behaviour before it.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import socket
import time
from importlib import metadata
from typing import Any, Callable, Mapping

import jax
from flax import traverse_util

from rloo_jax.config_utils import base_config

CONFIG_FILE = "run_config.json"
LOCK_FILE = "run.lock"

# May change on resume: how long the run is and how often it logs, evaluates and saves.
RESUMABLE_KEYS = (
    "train.num_iterations", "train.eval_every", "train.log_every", "train.checkpoint_every",
    "train.keep_checkpoints", "train.progress_bar", "train.max_nonfinite_steps",
    "train.max_unscorable_iterations", "train.wandb_project", "rewards.timeout_s", "dpo.steps",
    "train.eval_samples", "train.eval_correct_at",
    "dpo.eval_every",
    "sft.log_every", "sft.checkpoint_every",
    # How the same computation is laid out in memory (gradient accumulation, log-prob chunks,
    # recomputation, rollout chunks) or checked: a run that ran out of memory resumes with less.
    "train.microbatch_size", "train.microbatch_tokens", "train.logprob_chunk_size",
    "train.fused_head_grad",
    "train.check_memory", "train.compilation_cache_dir", "model.remat", "model.remat_names",
    "model.attention",
    "rloo.rollout_chunk_prompts", "rloo.rollout_engine",
    # The rollout engine draws the static sampler's tokens whatever its slots and pages.
    "rloo.rollout_slots", "rloo.rollout_prefix_rows", "rloo.rollout_pages",
    "rloo.rollout_page_size",
)
# Options of a reward spec (`fn?workers=16`) that say how the reward runs, not what it scores:
# math_answer's worker processes, a reward model's batch. A run resumes on another host with them.
RESUMABLE_SPEC_OPTIONS = ("workers", "batch_size")
_PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "chex", "ml_collections",
             "rloo_jax")


class ConfigMismatchError(ValueError):
  """The workdir's run was started with another config."""


class WorkdirLockedError(RuntimeError):
  """Another live process is running in this workdir."""


def versions() -> dict[str, str]:
  out = {}
  for name in _PACKAGES:
    try:
      out[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
      out[name] = "not installed"
  return out


def flat_config(config, default: Callable[[Any], str] = repr) -> dict[str, Any]:
  """The config as {'section.key': JSON value}; callables and other objects by `default`."""
  tree = json.loads(json.dumps(config.to_dict(), default=default))
  flat = traverse_util.flatten_dict(tree, sep=".", keep_empty_nodes=True)
  return {k: {} if v is traverse_util.empty_node else v for k, v in flat.items()}


def config_differences(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
  """The keys whose values differ (or exist on one side only), RESUMABLE_KEYS excluded; a key
  missing from `saved` whose current value is its base_config default is no difference."""
  defaults = flat_config(base_config())
  keys = sorted(set(saved) | set(current))

  def was(k):
    return saved.get(k, defaults.get(k, "<absent>"))
  def scored(k, v):  # the reward specs as they score: no RESUMABLE_SPEC_OPTIONS
    return [_scored_spec(s) for s in v] if k == "rewards.fns" and isinstance(v, list) else v
  return [k for k in keys if k not in RESUMABLE_KEYS
          and scored(k, was(k)) != scored(k, current.get(k, "<absent>"))]


def _scored_spec(spec):
  """A reward spec without its RESUMABLE_SPEC_OPTIONS, its other options in sorted order."""
  if not isinstance(spec, str) or "?" not in spec:
    return spec
  head, _, query = spec.partition("?")
  kept = sorted(p for p in query.split("&") if p.partition("=")[0] not in RESUMABLE_SPEC_OPTIONS)
  return head + ("?" + "&".join(kept) if kept else "")


def check_config(workdir: str, config, *, log: Callable[[str], None] = print) -> None:
  """Saves the config and versions at the first start; on a restart, raises
  ConfigMismatchError naming every differing key unless they may change on resume. Over several
  processes, first that the workdir is one directory for all (`check_shared`)."""
  check_shared(workdir)
  path = os.path.join(workdir, CONFIG_FILE)
  current = flat_config(config)
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      saved_file = json.load(f)
    saved = saved_file["config"]
    diff = config_differences(saved, current)
    if diff:
      shown = "\n".join(f"  config.{k}: {json.dumps(saved.get(k, '<absent>'))} in the workdir, "
                        f"{json.dumps(current.get(k, '<absent>'))} now" for k in diff[:20])
      more = f"\n  ... and {len(diff) - 20} more" if len(diff) > 20 else ""
      raise ConfigMismatchError(
          f"{workdir} holds a run started with another config ({path}); differing keys:\n"
          f"{shown}{more}\nNothing was changed. Use a new --workdir for the new config, or "
          f"restart with the saved values. Keys that may change on resume: "
          f"{', '.join(RESUMABLE_KEYS)}.")
    if saved_file.get("versions") != versions():
      log(f"[workdir] note: library versions differ from the run's start "
          f"({saved_file.get('versions')} then, {versions()} now)")
    changed = {k for k in set(saved) | set(current) if saved.get(k) != current.get(k)}
    if not changed:
      return
    log(f"[workdir] resumable settings changed: {', '.join(sorted(changed))}")
  if jax.process_index() == 0:
    os.makedirs(workdir, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
      json.dump({"config": current, "versions": versions()}, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def blind_processes(path: str) -> list:
  """The processes that cannot see a file process 0 writes in directory `path` (another host's
  own disk where one shared directory was meant; '' sees nothing); [] in a single process.
  Every process of a multi-process run calls this, and all get the same answer."""
  if jax.process_count() == 1:
    return []
  import numpy as np  # pylint: disable=import-outside-toplevel
  from etils import epath  # pylint: disable=import-outside-toplevel
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

  def attempt(fn):  # a failure here is a process that does not see the file, never a hang
    try:
      return fn()
    except Exception:  # pylint: disable=broad-except
      return False

  marker = lambda t: epath.Path(path) / f".rloo_jax_shared_{t}"
  token = np.int32(int.from_bytes(os.urandom(4), "little") >> 1)
  if jax.process_index() == 0 and path:
    attempt(lambda: epath.Path(path).mkdir(parents=True, exist_ok=True)
            or marker(int(token)).write_text(""))
  token = int(multihost_utils.broadcast_one_to_all(token))  # process 0's, after its write
  seen = bool(path) and attempt(marker(token).exists)
  seen = np.asarray(multihost_utils.process_allgather(np.bool_(seen)))
  if jax.process_index() == 0 and path:
    attempt(lambda: marker(token).unlink(missing_ok=True))  # every process has looked (gather)
  return [i for i, s in enumerate(seen.reshape(-1)) if not s]


# Where each host finds its own files: these may differ between the processes of one run.
PER_HOST_KEYS = ("train.compilation_cache_dir", "model.init_from", "data.source_dir",
                 "data.jsonl_train", "data.jsonl_test")


def check_same_config(config) -> None:
  """Multi-process: every process started with the same config (PER_HOST_KEYS aside), library
  versions and rloo_jax code, or a ValueError on every process naming what differs: a process
  on another config runs other programs, and the rest wait on collectives it never joins."""
  if jax.process_count() == 1:
    return
  import numpy as np  # pylint: disable=import-outside-toplevel
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  flat = {k: v for k, v in flat_config(config, default=_portable_name).items()
          if k not in PER_HOST_KEYS}
  sections = sorted(base_config().keys())  # the same list on every process
  digest = lambda kv: int(hashlib.sha256(json.dumps(sorted(kv), default=str).encode())
                          .hexdigest()[:8], 16) >> 1
  labels = [f"config.{s}" for s in sections] + ["the library versions", "rloo_jax's code"]
  columns = [digest([(k, v) for k, v in flat.items() if k.split(".")[0] == s]) for s in sections]
  columns += [digest(versions().items()), digest([("code", code_digest())]),
              digest(flat.items())]  # the last: every key
  got = np.asarray(multihost_utils.process_allgather(np.array(columns, np.int32)))
  got = got.reshape(jax.process_count(), -1)
  if (got == got[0]).all():
    return
  differ = [l for j, l in enumerate(labels) if (got[:, j] != got[0, j]).any()] or ["a config key"]
  others = [str(i) for i in range(1, len(got)) if (got[i] != got[0]).any()]
  raise ValueError(f"the processes did not start alike: {', '.join(differ)} of process(es) "
                   f"{', '.join(others)} differ from process 0's; start every process with the "
                   f"same --config, overrides, library versions and code")


def code_digest() -> str:
  """rloo_jax's own Python files, hashed: a host on a stale checkout differs here even where the
  version string does not."""
  root, h = os.path.dirname(os.path.abspath(__file__)), hashlib.sha256()
  for folder, subfolders, files in os.walk(root):
    subfolders.sort()
    for name in sorted(f for f in files if f.endswith(".py")):
      path = os.path.join(folder, name)
      h.update(os.path.relpath(path, root).encode())
      with open(path, "rb") as f:
        h.update(f.read())
  return h.hexdigest()


def _portable_name(obj) -> str:
  """A config value JSON cannot hold, by a name the same in every process (a callable's repr
  holds its address)."""
  kind = obj if callable(obj) and hasattr(obj, "__qualname__") else type(obj)
  return f"{getattr(kind, '__module__', '')}:{getattr(kind, '__qualname__', repr(kind))}"


def check_shared(workdir: str) -> None:
  """Multi-process: one workdir for all processes, or a ValueError on every process before
  anything is written (process 0 alone prepares the data, writes the metrics and commits each
  Orbax checkpoint that every process writes its shards into)."""
  blind = blind_processes(workdir)
  if blind:
    raise ValueError(f"--workdir {workdir} is not one directory for all processes: "
                     f"{len(blind)} of {jax.process_count()} ({', '.join(map(str, blind))}) "
                     f"cannot see a file process 0 wrote there; give every process the same "
                     f"--workdir on a filesystem all hosts mount")


def closest_key(name: str, keys) -> str | None:
  """The known key most like `name` (for an unknown-key error), or None."""
  match = difflib.get_close_matches(name, list(keys), n=1, cutoff=0.5)
  return match[0] if match else None


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


# An unreadable lock younger than this may be mid-write by a process of an older version.
STALE_UNREADABLE_S = 30.0


class Lock:
  """An exclusive claim on a workdir for one live process (one per process index of a
  multi-process run). A lock left by a dead process is taken over with a message."""

  def __init__(self, workdir: str, *, log: Callable[[str], None] = print):
    self.path = os.path.join(workdir, f"{LOCK_FILE}.{jax.process_index()}")
    self.log = log
    self.held = False

  def acquire(self) -> "Lock":
    os.makedirs(os.path.dirname(self.path), exist_ok=True)
    me = {"pid": os.getpid(), "host": socket.gethostname()}
    # Written whole to a private file, then linked to the lock's name (atomic, and fails if the
    # name exists): no reader ever sees a lock without its pid.
    tmp = f"{self.path}.{me['pid']}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
      json.dump(me, f)
    try:
      for _ in range(2):
        try:
          self._publish(tmp, me)
        except FileExistsError:
          if self._check_other(me):
            return self  # held by this process already (an outer call releases it)
          continue
        self.held = True
        return self
    finally:
      os.remove(tmp)
    raise WorkdirLockedError(f"could not take the lock {self.path}")

  def _publish(self, tmp: str, me: dict) -> None:
    """Makes the lock visible with its content: a hard link of `tmp`, or where hard links are
    refused (e.g. gcsfuse) create-if-absent, then write. FileExistsError if it is taken."""
    try:
      os.link(tmp, self.path)
    except FileExistsError:
      raise
    except OSError:
      with os.fdopen(os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY), "w") as f:
        json.dump(me, f)

  def _check_other(self, me: dict) -> bool:
    """True if this process holds the lock; False after removing a stale one; raises if another
    live run holds it."""
    try:
      with open(self.path, encoding="utf-8") as f:
        other = json.load(f)
      age = None
    except (OSError, ValueError):
      other = {}
      try:
        age = time.time() - os.path.getmtime(self.path)
      except OSError:
        return False  # released meanwhile
    pid = int(other.get("pid", -1))
    if pid == me["pid"]:
      return True
    if pid < 0 and age is not None and age < STALE_UNREADABLE_S:
      # A lock an older version of this code (or a crashed write) left unreadable: fresh, so
      # another process may be writing it. Never taken over until it is old.
      raise WorkdirLockedError(
          f"{os.path.dirname(self.path)} has an unreadable lock {self.path} written "
          f"{age:.0f} s ago; another run may be starting: wait, or use another --workdir")
    if pid > 0 and (other.get("host") != me["host"] or _alive(pid)):
      raise WorkdirLockedError(
          f"{os.path.dirname(self.path)} is in use by another run (pid {pid} on "
          f"{other.get('host')}, lock {self.path}); wait for it to finish or use another "
          f"--workdir. If that run is gone, delete the lock file.")
    self.log(f"[workdir] taking over the stale lock of "
             f"{f'pid {pid}' if pid > 0 else 'an unreadable lock'} ({self.path})")
    os.remove(self.path)
    return False

  def release(self) -> None:
    if self.held:
      try:
        os.remove(self.path)
      except FileNotFoundError:
        pass
      self.held = False

  def __enter__(self):
    return self.acquire()

  def __exit__(self, *exc):
    self.release()

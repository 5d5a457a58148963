"""What the command-line entry points (`rloo_jax.train`, `rloo_jax.plan`) share: list-valued
config overrides and the check of `--config.a.b=...` keys before absl parses them.

Importing this module registers the list parser with ml_collections' config flags, so import it
before defining a config flag.
"""

import os

from absl import flags
import jax
from ml_collections import config_flags

from rloo_jax import config_utils
from rloo_jax import workdir as workdir_lib


class _CommaList(flags.ArgumentParser):
  """List settings from the command line as comma-separated values, e.g.
  `--config.rewards.fns=my_reward.py:score,rloo_jax.rewards.verifiers:arithmetic_exact_match`
  and `--config.rewards.weights=1,0` (ml_collections refuses list overrides otherwise). All
  numbers -> floats; anything else stays a list of strings."""

  def parse(self, argument):
    if isinstance(argument, (list, tuple)):
      return list(argument)
    items = [item.strip() for item in str(argument).split(",") if item.strip()]
    try:
      return [float(item) for item in items]
    except ValueError:
      return items

  def flag_type(self):
    return "comma-separated list"


config_flags.register_flag_parser_for_type(list, _CommaList())


def check_overrides(argv) -> None:
  """Unknown `--config.a.b=...` keys, caught before absl parses them (which prints a long
  traceback): the message names the closest known key."""
  spec = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
  overrides = [a[len("--config."):].split("=", 1)[0] for a in argv if a.startswith("--config.")]
  if spec is None or not overrides:
    return
  path, _, arg = spec.partition(":")
  try:
    flat = workdir_lib.flat_config(config_utils.load_config_file(path, arg))
  except FileNotFoundError as e:
    raise FileNotFoundError(f"--config={spec}: {e}") from None
  sections = {k.rsplit(".", 1)[0] for k in flat}
  for name in overrides:
    if name in flat or name in sections:
      continue
    # A key inside a dict-valued setting (e.g. advantage.options.eps) is the config's to judge.
    if any(name.startswith(k + ".") for k in flat):
      continue
    near = workdir_lib.closest_key(name, flat)
    hint = f"; did you mean --config.{near}?" if near else ""
    raise ValueError(f"unknown config key --config.{name} (not in {spec}){hint}")


def compilation_cache_dir(config) -> str:
  """Where compiled programs persist between starts: env JAX_COMPILATION_CACHE_DIR if set, else
  config.train.compilation_cache_dir ('auto': $XDG_CACHE_HOME/rloo_jax/xla, by default
  ~/.cache/rloo_jax/xla; '': none)."""
  if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    return os.environ["JAX_COMPILATION_CACHE_DIR"]
  value = str(config.train.get("compilation_cache_dir", "auto") or "")
  if value != "auto":
    return os.path.expanduser(value)
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "rloo_jax", "xla")


def setup_compilation_cache(config, log=print) -> str:
  """Turns on JAX's persistent compilation cache before the first compile, so a second start of
  the same job loads its programs instead of compiling them. Returns the directory ('' = off:
  also when a local directory cannot be written, said in one line, or the cache is off already:
  env JAX_ENABLE_COMPILATION_CACHE=false, or processes whose cache keys differ)."""
  if not jax.config.jax_enable_compilation_cache:
    return ""
  path = compilation_cache_dir(config)
  if path and "://" not in path:  # a local directory (a URL is etils.epath's, as in JAX)
    try:
      os.makedirs(path, exist_ok=True)
      reason = "" if os.access(path, os.W_OK) else "not writable"
    except OSError as e:
      reason = f"{type(e).__name__}: {e.strerror}"
    if reason:
      log(f"[compile] cannot write the compilation cache {path} ({reason}): nothing is kept "
          f"between starts; set --config.train.compilation_cache_dir (or env "
          f"JAX_COMPILATION_CACHE_DIR) to a writable directory, or '' for none")
      jax.config.update("jax_enable_compilation_cache", False)  # env's directory included
      return ""
  if path:
    jax.config.update("jax_compilation_cache_dir", path)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
      # jax's default (1 s) leaves out the many small programs a run compiles, which together
      # take most of a small job's start.
      jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
  return path


def unshared_cache_line(path: str):
  """Multi-process: the line process 0 prints when another process cannot read the compilation
  cache `path` (each host's own disk), else None. JAX writes the cache from process 0 only, so
  such a process compiles every program at every start, a preempted job's restart included.
  Every process calls this (`workdir.blind_processes`), its cache off ('') too."""
  blind = workdir_lib.blind_processes(path)
  if not path or not blind or jax.process_index() != 0:
    return None
  return (f"[compile] {len(blind)} of {jax.process_count()} processes "
          f"({', '.join(map(str, blind))}) cannot read the compilation cache {path} (JAX writes "
          f"it from process 0 only), so they compile every program at every start; set "
          f"--config.train.compilation_cache_dir (or env JAX_COMPILATION_CACHE_DIR) to a "
          f"directory every host reads")


def error_line(prog: str, e: BaseException) -> str:
  """A user error as the one line the entry points print: the message, and after a mid-run
  failure where a rerun resumes (`loop.run` sets `resume_from`)."""
  where = getattr(e, "resume_from", None)
  return f"{prog}: error: {e}" + (f"; rerun the same command to resume from {where}"
                                   if where else "")

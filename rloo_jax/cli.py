"""What the command-line entry points (`rloo_jax.train`, `rloo_jax.plan`) share: list-valued
config overrides and the check of `--config.a.b=...` keys before absl parses them.

Importing this module registers the list parser with ml_collections' config flags, so import it
before defining a config flag.
"""

from absl import flags
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

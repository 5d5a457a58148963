r"""Entry point: train a policy with RLOO.

    python -m rloo_jax.train --config=configs/arithmetic.py --workdir=/tmp/rloo_arith
    python -m rloo_jax.train --config=configs/arithmetic.py:smoke --workdir=/tmp/smoke \
        --config.rloo.k=2

The logic lives in `rloo_jax.trainer` so it can be imported, tested and driven from a notebook.
Running again with the same workdir resumes from its newest checkpoint.
"""
from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from rloo_jax import trainer

_CONFIG = config_flags.DEFINE_config_file("config", None, "get_config(arg) file (path[:arg])",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "directory for checkpoints, logs and data")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    # Orbax logs every file it writes at INFO; --verbosity=0 brings that back.
    logging.set_verbosity(logging.WARNING)
  trainer.run(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main)

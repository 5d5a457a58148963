r"""The whole RLHF pipeline in one command: SFT -> preference pairs -> reward model -> RLOO ->
win rate vs SFT judged by the gold reward, gold-vs-proxy and reward-vs-KL plots.

    python experiments/rlhf_pipeline.py --config=configs/summarize.py --workdir=/tmp/rlhf
    python experiments/rlhf_pipeline.py --config=configs/summarize.py:smoke --workdir=/tmp/rlhf_s \
        --config.kl.beta=0.01   # any --config.* override (docs/RLHF.md)

Prints the table (also <workdir>/rlhf_table.md) and writes gold_vs_proxy.png, reward_vs_kl.png and
rlhf_summary.json into the workdir; a rerun reuses finished stages (`rloo_jax.rlhf.pipeline`).
"""
from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from rloo_jax.rlhf import pipeline

_CONFIG = config_flags.DEFINE_config_file("config", None, "get_config(arg) file (path[:arg])")
_WORKDIR = flags.DEFINE_string("workdir", None, "directory for every stage's outputs and caches")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # Orbax logs every file it writes at INFO
  pipeline.run(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main)

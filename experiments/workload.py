"""The benchmark workload's flags, shared by bench_step.py (rloo_jax), bench_trl_rloo.py (TRL,
in its torch venv) and bench_tunix_rloo.py (Tunix, in its own venv): argparse only, so every
interpreter imports it, and the three sides are always given the same work by the same names."""


def add_workload_flags(parser, *, steps_help: str = "timed iterations after warm-up"):
  """The model shape (a Llama with random weights), the batch and the completion budget."""
  parser.add_argument("--hidden", type=int, default=64)
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--vocab", type=int, default=256)
  parser.add_argument("--prompts", type=int, default=8)
  parser.add_argument("--prompt_len", type=int, default=16)
  parser.add_argument("--k", type=int, default=4)
  parser.add_argument("--new_tokens", type=int, default=32)
  parser.add_argument("--iterations", type=int, default=12, help=steps_help)

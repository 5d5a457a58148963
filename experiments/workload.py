"""The benchmark workload's flags, shared by bench_step.py (rloo_jax), bench_trl_rloo.py (TRL,
in its torch venv) and bench_tunix_rloo.py (Tunix, in its own venv): argparse only, so every
interpreter imports it, and the three sides are always given the same work by the same names."""


def add_workload_flags(parser, *, steps_help: str = "timed iterations after warm-up"):
  """The model shape (a Llama with random weights), the batch and the completion budget."""
  for flag, default in (("hidden", 64), ("layers", 2), ("heads", 4), ("vocab", 256),
                        ("prompts", 8), ("prompt_len", 16), ("k", 4), ("new_tokens", 32)):
    parser.add_argument(f"--{flag}", type=int, default=default)
  parser.add_argument("--iterations", type=int, default=12, help=steps_help)

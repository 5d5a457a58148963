r"""Competition-math answers (MATH, AIME, DeepScaleR's data) checked for mathematical equality by
Hugging Face's math-verify (`pip install 'rloo_jax[math]'`).

  math_answer(prompts, completions, *, answer, stop=None, think=False, timeout_s=5,
              workers=min(8, CPUs))                          1.0 / 0.0 / NaN per completion
  math_answer.answer_ids(completions, k, think=False, ...)  maj@n's votes, int32 [N / k, k]

The completion's answer is its \boxed{...} or, failing that, a LaTeX answer after "final answer
is", read after its last `</think>` when it has one (a reasoning model's answer follows its
thoughts, which may box drafts). With think=True (`math_answer?think=true`, DeepScaleR's rule
for R1-style models) a completion that never closes its thoughts, e.g. cut at the token cap,
scores 0. Several boxed answers read as one set, so boxing every candidate scores 0. The
reference (`answer`: bare LaTeX such as `\frac{3}{4}`, or a solution holding a \boxed{}) is
read as if boxed. Equality is math-verify's: 0.75 = 3/4 = \dfrac{3}{4}, 2\sqrt{3} = \sqrt{12},
intervals, sets, equations, percentages and units normalised. The extraction settings are TRL's
and open-r1's accuracy reward. NaN (unscorable, masked out of the baselines) where the reference
is missing or holds no answer math-verify can read.

math-verify bounds each parse and comparison with SIGALRM, which only a main thread may set, and
rewards run on a thread under config.rewards.timeout_s: so the checks run in worker processes
(rewards/math_worker.py, started at the first call, `workers` of them), each in its main
thread, where an answer such as 9^{9^{9^{9}}} times out after `timeout_s` and scores 0 instead
of hanging sympy. They are plain subprocesses of a script that imports only math-verify, not
multiprocessing's: a spawned child would first re-run the script that started training. A
config sets both in the spec: `rloo_jax.rewards.math_answer:math_answer?timeout_s=10&workers=16`.
"""

from __future__ import annotations

import atexit
import os
import pickle
import subprocess
import sys
import threading
from typing import Any, Sequence

import numpy as np

from rloo_jax.rewards import answers

try:
  import math_verify  # noqa: F401  (the workers' import, failing here, at resolve time)
except ImportError as e:  # an optional extra: say how to get it
  raise ImportError(f"config.rewards.fns names rloo_jax.rewards.math_answer, which needs "
                    f"math-verify ({e}): pip install 'rloo_jax[math]'") from None

TIMEOUT_S = 5  # whole seconds (SIGALRM's) per parse and per comparison (math-verify's default)
WORKERS = min(8, os.cpu_count() or 1)
THINK_END = "</think>"  # R1-style reasoning models' end of thoughts

_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "math_worker.py")
_workers: list = []
_lock = threading.Lock()  # one batch at a time over the workers' pipes


def _start() -> subprocess.Popen:
  # -P: the script's folder stays off sys.path (its module names must not shadow a library's).
  return subprocess.Popen([sys.executable, "-P", _WORKER], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE)


@atexit.register
def _stop() -> None:
  for w in _workers:
    w.kill()
  _workers.clear()


def _run(op: str, chunks: list, timeout_s: int) -> list:
  """math_worker's `op` (score or group) of each chunk, one chunk a worker."""
  with _lock:
    for i, w in enumerate(_workers):
      if w.poll() is not None:  # exited between calls (killed): its batch is not lost
        print(f"[math_answer] a worker process had exited (code {w.returncode}); starting "
              "another", file=sys.stderr)
        _workers[i] = _start()
    while len(_workers) < len(chunks):
      _workers.append(_start())
    busy = _workers[:len(chunks)]
    try:
      for w, chunk in zip(busy, chunks):
        pickle.dump((op, chunk, timeout_s), w.stdin)
        w.stdin.flush()
      return [pickle.load(w.stdout) for w in busy]
    except (EOFError, BrokenPipeError, pickle.UnpicklingError):
      codes = [_exit_code(w) for w in busy]
      _stop()  # the next call starts afresh
      raise RuntimeError(f"rloo_jax.rewards.math_answer: a worker process died scoring a batch "
                         f"(exit codes {codes}; killed, or out of memory); its error is above"
                         ) from None


def _answer_part(text: str, think: bool) -> str:
  i = text.rfind(THINK_END)
  if i < 0:
    return "" if think else text  # "": no answer, 0 (NaN still where the reference is)
  return text[i + len(THINK_END):]


def _check(timeout_s, workers) -> None:
  if not all(isinstance(v, int) and v >= 1 for v in (timeout_s, workers)):
    raise ValueError(f"rloo_jax.rewards.math_answer: timeout_s={timeout_s!r} and workers="
                     f"{workers!r} must be whole numbers >= 1 (math_answer?timeout_s=5&workers=8)")


def answer_ids(completions: Sequence[str], k: int, *, think: bool = False,
               timeout_s: int = TIMEOUT_S, workers: int = WORKERS) -> np.ndarray:
  """int32 [N / k, k], maj@n's votes (rloo_jax.evaluation): for each group of k completions,
  the index of the first in its group whose answer math-verify finds equal to this one's (the
  reading and equality of the scores, so \\frac{1}{3} and 1/3 vote together, right or wrong);
  -1 where it reads no answer (or, under think=True, the thoughts never closed): no vote."""
  _check(timeout_s, workers)
  parts = [_answer_part(c, think) for c in completions]
  groups = [parts[i:i + k] for i in range(0, len(parts), k)]
  if not groups:
    return np.zeros((0, k), np.int32)
  chunks = np.array_split(np.arange(len(groups)), min(len(groups), workers))
  done = _run("group", [[groups[j] for j in c] for c in chunks], timeout_s)
  return np.asarray([ids for chunk in done for ids in chunk], np.int32).reshape(-1, k)


def _exit_code(worker):
  try:
    return worker.wait(timeout=1)  # the pipe closes a moment before the process ends
  except subprocess.TimeoutExpired:
    return None  # still running: another worker's pipe broke


def math_answer(prompts: Sequence[str], completions: Sequence[str], *,
                answer: Sequence[Any] | None = None, stop: str | None = None,
                think: bool = False, timeout_s: int = TIMEOUT_S, workers: int = WORKERS,
                **fields: Any) -> np.ndarray:
  """float32 [N]: 1.0 where the completion (cut at `stop`, an eos string for tokenizers that
  decode it) states an answer equal to the reference, 0.0 where it does not or states none, NaN
  where the reference is missing or unreadable."""
  del fields
  _check(timeout_s, workers)

  def score_all(pairs):
    pairs = [(_answer_part(c, think), a.strip()) for c, a in pairs]
    # Contiguous chunks keep a prompt's k completions together: its reference is parsed once.
    chunks = np.array_split(np.arange(len(pairs)), min(len(pairs), workers))
    return np.concatenate(_run("score", [[pairs[j] for j in c] for c in chunks], timeout_s))
  return answers.against_answers_batch(prompts, completions, answer, stop, score_all)


math_answer.answer_ids = answer_ids  # evaluation's majority vote

r"""What the rollout's decode loop gathers under FSDP, per token and per rollout, for each
`config.rloo.decode_layers` layout: the decode program compiled as the memory plan compiles it
(abstract inputs, simulated devices, as for an accelerator), its all-gathers read from the HLO
right after SPMD partitioning (before XLA:CPU's own float32 rewrites, so in the dtypes an
accelerator gathers).

Prints one JSON line per layout: `gathered_per_token_gb` (the all-gathers inside the token
loop: the gathered buffers' bytes on one device, summed over one token's program),
`gathered_per_rollout_gb` (those outside it, once per decode call), their dtypes, and the
decode program's `peak_gb` per device (XLA:CPU's: a copy of gathered bf16 weights is counted in
float32 there, `memory.speedups`).

    python experiments/decode_traffic.py --config=configs/tldr.py:model=pythia-6.9b,k=4 --devices=8
"""
import collections
import glob
import json
import os
import re
import sys
import tempfile

from absl import app
from absl import flags
import jax
from ml_collections import config_flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rloo_jax import cli  # noqa: E402  (registers the list parser before the config flag)

_CONFIG = config_flags.DEFINE_config_file("config", None, "get_config(arg) file (path[:arg])",
                                          lock_config=False)
flags.mark_flags_as_required(["config"])
_DEVICES = flags.DEFINE_integer("devices", 8, "simulated CPU devices")
_LAYOUTS = flags.DEFINE_list("layouts", ["scanned", "unstacked"], "config.rloo.decode_layers")

_ITEMSIZE = {"f32": 4, "bf16": 2, "f16": 2, "f64": 8, "s32": 4, "u32": 4, "s8": 1, "u8": 1,
             "pred": 1}
_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) ")
_CALLED = re.compile(r"(?:calls|to_apply|body|condition)=%([\w.\-]+)")
_GATHER = re.compile(r"= (\w+)\[([\d,]*)\][^ ]* all-gather(?:-start)?\(")


def gathers(hlo: str) -> dict:
  """{'per_token' | 'per_rollout': {dtype: bytes}} of a partitioned decode module's
  all-gathers: inside the token loop (the entry's while with the largest body) or not. A loop
  nested in a token (the layer scan) counts its gathers once per trip; its trip count is the
  constant its condition compares the counter with."""
  own = collections.defaultdict(collections.Counter)  # computation -> {dtype: bytes}
  calls = collections.defaultdict(list)  # computation -> [(callee, times)]
  consts = collections.defaultdict(list)  # computation -> its s32 constants
  entry = name = None
  for line in hlo.splitlines():
    m = _COMPUTATION.match(line)
    if m:
      name = m.group(1)
      entry = name if line.startswith("ENTRY") else entry
      continue
    w = re.search(r"condition=%([\w.\-]+), body=%([\w.\-]+)", line)
    if w:
      calls[name].append(("while", w.group(1), w.group(2)))
    else:
      calls[name].extend(("call", c, None) for c in _CALLED.findall(line))
    consts[name] += [int(c) for c in re.findall(r"s32\[\] constant\((\d+)\)", line)]
    g = _GATHER.search(line)
    if g:
      n = 1
      for d in filter(None, g.group(2).split(",")):
        n *= int(d)
      own[name][g.group(1)] += n * _ITEMSIZE[g.group(1)]

  def cost(comp, skip=None) -> collections.Counter:
    total = collections.Counter(own[comp])
    for kind, a, b in calls[comp]:
      if kind == "call":
        total.update(cost(a))
      elif (a, b) != skip:
        trips = max(consts[a], default=1)
        total.update({k: v * trips for k, v in cost(b).items()})
    return total

  def size(comp, seen=()):
    return 1 + sum(size(c, seen + (comp,)) for _, c, b in calls[comp] for c in (c, b)
                   if c and c not in seen)

  loops = [(a, b) for kind, a, b in calls[entry] if kind == "while"]
  token = max(loops, key=lambda w: size(w[1])) if loops else None
  return {"per_token": dict(cost(token[1]) if token else {}),
          "per_rollout": dict(cost(entry, skip=token))}


def main(argv):
  del argv
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", int(_DEVICES.value))
  # A program loaded from the persistent compilation cache is not compiled, so dumps nothing.
  jax.config.update("jax_enable_compilation_cache", False)
  from rloo_jax import algorithms, experiment  # pylint: disable=import-outside-toplevel
  from rloo_jax.memory import programs  # pylint: disable=import-outside-toplevel
  _, base = algorithms.resolve(_CONFIG.value)
  for layout in _LAYOUTS.value:
    config = base.copy_and_resolve_references()
    config.rloo.decode_layers = layout
    exp = experiment.build_abstract(config)
    with tempfile.TemporaryDirectory() as d:
      options = dict(programs.ACCELERATOR_OPTIONS, xla_dump_to=d,
                     xla_dump_hlo_pass_re="spmd-partitioning")
      compiled = programs.compile_programs(algorithms.ALGORITHMS["rloo"](exp),
                                           ("start", "decode"), options=options)
      path = glob.glob(os.path.join(d, "*jit_decode_loop*after_spmd-partitioning*"))[0]
      with open(path) as f:
        found = gathers(f.read())
    gb = lambda counts: sum(counts.values()) / 2 ** 30  # noqa: E731
    m = exp.model_config
    print(json.dumps(dict(
        decode_layers=layout, mesh=exp.layout.shape, num_params=int(m.num_params),
        dtype=m.dtype, param_dtype=m.param_dtype,
        gathered_per_token_gb=gb(found["per_token"]),
        gathered_per_rollout_gb=gb(found["per_rollout"]),
        gathered_dtypes={k: sorted(v) for k, v in found.items()},
        max_new_tokens=int(config.rloo.max_new_tokens),
        peak_gb=compiled.programs["decode"].peak / 2 ** 30)), flush=True)


if __name__ == "__main__":
  cli.check_overrides(sys.argv[1:])
  app.run(main)

"""Rollout latency of the sampler: prefix-shared KV cache vs unshared vs HF generate.

Prints ONE JSON line: seconds per rollout (median over --repeats, after a compiling warm-up call)
and tokens/s for
  shared_s      KV cache, each prompt prefilled once and kept once for its k streams (the
                sampler's default: the layer scan over the stacked weights and cache)
  unshared_s    KV cache, prompts tiled k times
  unstacked_s   'shared' on per-layer weight and KV buffers split before the decode loop
                (`sampler.sample(unstack_layers=True)`, config.rloo.decode_layers='unstacked')
  hf_generate_s transformers' LlamaForCausalLM.generate (torch CPU, KV cache) on the same weights
                and sampling settings; null when torch/transformers are not importable
plus the configuration and ratios. Modes are timed round-robin in one process, so load hits
them alike (compare_generate.py runs each in a process of its own).

  python experiments/bench_sampler.py --prompt_len=512 --new_tokens=32 --modes=shared,unshared,hf
  python experiments/bench_sampler.py --prompt_len=64 --new_tokens=64 --modes=shared,unstacked
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rloo_jax import sampler, sampling  # noqa: E402
from rloo_jax.models import transformer  # noqa: E402

ALL_MODES = ('shared', 'unshared', 'unstacked', 'hf')
CONFIG_FLAGS = ('prompt_len', 'new_tokens', 'prompts', 'k', 'vocab', 'hidden', 'layers', 'heads',
                'kv_heads', 'intermediate', 'dtype', 'repeats')


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument('--prompt_len', type=int, default=64)
  p.add_argument('--new_tokens', type=int, default=64)
  p.add_argument('--prompts', type=int, default=8)
  p.add_argument('--k', type=int, default=4)
  p.add_argument('--vocab', type=int, default=4096)
  p.add_argument('--hidden', type=int, default=256)
  p.add_argument('--layers', type=int, default=8)
  p.add_argument('--heads', type=int, default=4)
  p.add_argument('--kv_heads', type=int, default=4)
  p.add_argument('--intermediate', type=int, default=1024)
  p.add_argument('--dtype', default='float32', choices=('float32', 'bfloat16'))
  p.add_argument('--method', default='temperature', choices=('greedy', 'temperature', 'topk', 'topp'))
  p.add_argument('--temperature', type=float, default=1.0)
  p.add_argument('--top_k', type=int, default=50)
  p.add_argument('--top_p', type=float, default=0.9)
  p.add_argument('--repeats', type=int, default=3)
  p.add_argument('--modes', default=','.join(ALL_MODES),
                 help='comma-separated subset of ' + ','.join(ALL_MODES))
  p.add_argument('--seed', type=int, default=0)
  args = p.parse_args(argv)
  args.modes = [m for m in args.modes.split(',') if m]
  unknown = set(args.modes) - set(ALL_MODES)
  if unknown:
    p.error(f'unknown modes {sorted(unknown)}')
  return args


def make_method(args):
  return {'greedy': lambda: sampling.Greedy(),
          'temperature': lambda: sampling.Temperature(args.temperature),
          'topk': lambda: sampling.TopK(args.top_k, args.temperature),
          'topp': lambda: sampling.TopP(args.top_p, args.temperature)}[args.method]()


# ----------------------------------------------------------------------------------------------
# Hugging Face side


def to_hf_llama(config, params):
  """Our Llama params as a transformers LlamaForCausalLM: written by the project's own exporter
  (`models.hf_export.save_pretrained`, float32) and loaded back by transformers."""
  import tempfile

  import torch
  import transformers

  from rloo_jax.models import hf_export

  with tempfile.TemporaryDirectory() as out:
    hf_export.save_pretrained(params, config, out, dtype='float32')
    hf = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32)
  return hf.eval().to(torch.float32 if config.dtype == 'float32' else torch.bfloat16)


def hf_generate_fn(hf_model, tokens, args, eos_id, pad_id):
  import torch
  import transformers

  sample_kw = dict(do_sample=args.method != 'greedy', top_k=0, top_p=1.0)
  if args.method != 'greedy':
    sample_kw['temperature'] = args.temperature
  if args.method == 'topk':
    sample_kw['top_k'] = args.top_k
  if args.method == 'topp':
    sample_kw['top_p'] = args.top_p
  gen_config = transformers.GenerationConfig(
      max_new_tokens=args.new_tokens, num_return_sequences=args.k, eos_token_id=eos_id,
      pad_token_id=pad_id, use_cache=True, **sample_kw)
  input_ids = torch.from_numpy(np.asarray(tokens, np.int64))
  attention_mask = torch.ones_like(input_ids)
  generator_seed = [args.seed]

  def run():
    torch.manual_seed(generator_seed[0])
    generator_seed[0] += 1
    with torch.inference_mode():
      return hf_model.generate(input_ids=input_ids, attention_mask=attention_mask,
                               generation_config=gen_config)
  return run


# ----------------------------------------------------------------------------------------------


def main(argv=None):
  args = parse_args(argv)
  config = transformer.TransformerConfig.llama(
      vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
      num_kv_heads=args.kv_heads, head_dim=args.hidden // args.heads,
      intermediate_size=args.intermediate, max_seq_len=args.prompt_len + args.new_tokens,
      dtype=args.dtype, param_dtype=args.dtype)
  graphdef, params = transformer.create(config, seed=args.seed)
  fns = transformer.model_fns(graphdef)
  rng = np.random.default_rng(args.seed)
  eos_id, pad_id = args.vocab - 1, 0
  tokens = jnp.asarray(rng.integers(2, args.vocab - 1, (args.prompts, args.prompt_len)), jnp.int32)
  lengths = jnp.full((args.prompts,), args.prompt_len, jnp.int32)
  method = make_method(args)
  kw = dict(k=args.k, max_new_tokens=args.new_tokens, method=method, eos_id=eos_id, pad_id=pad_id)

  runners, compile_s, mean_len = {}, {}, {}
  for mode in args.modes:
    if mode == 'hf':
      continue
    sampler_mode, layout = mode, {}
    if mode == 'unstacked':
      sampler_mode, layout = 'shared', {'unstack_layers': True}

    def run(sampler_mode=sampler_mode, layout=layout, counter=[0]):  # noqa: B006
      counter[0] += 1  # a fresh rng per rollout, as in training
      out = sampler.sample(fns, params, tokens, lengths, jax.random.key(counter[0]),
                           mode=sampler_mode, **layout, **kw)
      jax.block_until_ready(out)
      return out
    t0 = time.perf_counter()
    run()  # compiles both programs
    compile_s[mode] = round(time.perf_counter() - t0, 2)
    runners[mode] = run

  hf_note = None
  if 'hf' in args.modes:
    try:
      import torch  # noqa: F401
      import transformers  # noqa: F401
    except ImportError as e:
      hf_note = f'torch/transformers not importable: {e}'
    else:
      hf_model = to_hf_llama(config, params)
      with torch.inference_mode():
        hf_logits = hf_model(torch.from_numpy(np.asarray(tokens[:2], np.int64))).logits.float()
      ours = jax.jit(fns.forward)(params, tokens[:2],
                                  jnp.broadcast_to(jnp.arange(args.prompt_len), (2, args.prompt_len)),
                                  jnp.ones((2, args.prompt_len), bool))
      hf_note = {'logits_max_abs_diff_vs_ours': float(np.abs(hf_logits.numpy() - np.asarray(ours)).max()),
                 'torch': torch.__version__, 'transformers': transformers.__version__,
                 'torch_threads': torch.get_num_threads()}
      runners['hf'] = hf_generate_fn(hf_model, tokens, args, eos_id, pad_id)
      runners['hf']()  # warm-up

  times = {mode: [] for mode in runners}
  for _ in range(args.repeats):  # round-robin, so slow drifts in machine load hit all modes alike
    for mode, run in runners.items():
      t0 = time.perf_counter()
      out = run()
      times[mode].append(time.perf_counter() - t0)
      if mode != 'hf':
        mean_len[mode] = float(np.mean(out.lengths_bk))

  def med(mode):
    return round(statistics.median(times[mode]), 4) if mode in times else None

  new_tokens_total = args.prompts * args.k * args.new_tokens
  result = {'shared_s': med('shared'), 'unshared_s': med('unshared'),
            'unstacked_s': med('unstacked'), 'hf_generate_s': med('hf')}
  for mode, key in (('shared', 'shared'), ('unshared', 'unshared'), ('unstacked', 'unstacked'),
                    ('hf', 'hf_generate')):
    result[f'{key}_tokens_per_s'] = (round(new_tokens_total / med(mode), 1) if mode in times
                                     else None)

  def ratio(a, b):
    return round(med(a) / med(b), 3) if a in times and b in times else None
  result.update(shared_over_unshared=ratio('shared', 'unshared'),
                unstacked_over_shared=ratio('unstacked', 'shared'),
                hf_generate_over_shared=ratio('hf', 'shared'),
                hf_generate_over_unstacked=ratio('hf', 'unstacked'))
  result.update({
      'config': {**{f: getattr(args, f) for f in CONFIG_FLAGS}, 'method': repr(method),
                 'num_params': config.num_params, 'jax': jax.__version__,
                 'backend': jax.default_backend(), 'cpu_count': os.cpu_count()},
      'all_times_s': {m: [round(t, 4) for t in ts] for m, ts in times.items()},
      'compile_s': compile_s,
      'mean_completion_len': mean_len,
      'hf': hf_note,
  })
  print(json.dumps(result))


if __name__ == '__main__':
  main()

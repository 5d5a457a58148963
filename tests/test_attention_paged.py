"""The Pallas TPU paged-attention kernel with its log-sum-exp (`models.attention_paged`), run in
Pallas' TPU interpreter: equal to the gathered reference, alone and joined with a shared prompt
and a stream's tail as the rollout engine's paged decode reads them. The interpreter rounds the
products' float32 operands to bfloat16 (the chip's default precision), so the inputs here are
bfloat16 values; a decode step has no gradient."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rloo_jax.models import attention_ops, attention_paged
from rloo_jax.models import cache as cache_lib


def _bf16(rs, *shape):
  return jnp.asarray(rs.normal(size=shape), jnp.bfloat16).astype(jnp.float32)


def _reference(q_bhd, k_pages, v_pages, lengths_b, pages_bm, softcap):
  hkv, _, g, d = k_pages.shape
  b, hq, _ = q_bhd.shape
  k = jnp.transpose(k_pages[:, pages_bm], (1, 0, 2, 3, 4)).reshape(b, hkv, -1, d)
  v = jnp.transpose(v_pages[:, pages_bm], (1, 0, 2, 3, 4)).reshape(b, hkv, -1, d)
  s = jnp.einsum('bhgd,bhtd->bhgt', q_bhd.reshape(b, hkv, hq // hkv, d), k,
                 precision='highest')
  if softcap:
    s = softcap * jnp.tanh(s / softcap)
  s = jnp.where(jnp.arange(s.shape[-1]) < lengths_b[:, None, None, None], s, -jnp.inf)
  lse = jax.nn.logsumexp(s, axis=-1)
  o = jnp.einsum('bhgt,bhtd->bhgd', jnp.exp(s - lse[..., None]), v, precision='highest')
  return o.reshape(b, hq, d), lse.reshape(b, hq)


@pytest.mark.numerics
@pytest.mark.parametrize('heads, softcap', [(4, 0.0), (16, 0.0), (4, 2.0)],
                         ids=['2_per_kv_head', '8_per_kv_head', 'soft_capped'])
def test_the_kernel_gives_the_reference_output_and_log_sum_exp(heads, softcap):
  """Streams of 0, 1, a page, a page and one, and every page of their tables (pages of 8 in a
  shared pool, tables in any order); 2 kv heads."""
  rs = np.random.RandomState(0)
  b, hkv, d, g, pages, m = 5, 2, 128, 8, 12, 4
  q = _bf16(rs, b, heads, d) * 0.25
  k_pages, v_pages = _bf16(rs, hkv, pages, g, d), _bf16(rs, hkv, pages, g, d)
  lengths = jnp.asarray([0, 1, g, g + 1, m * g], jnp.int32)
  table = jnp.asarray(rs.permutation(pages)[:m][None] + np.zeros((b, 1), int), jnp.int32)
  table = table.at[2].set(jnp.asarray(rs.permutation(pages)[:m]))
  o, lse = attention_paged.attend(q, k_pages, v_pages, lengths, table, softcap=softcap,
                                  interpret=True)
  o_ref, lse_ref = _reference(q, k_pages, v_pages, lengths, table, softcap)
  assert o.dtype == lse.dtype == jnp.float32 and o.shape == (b, heads, d)
  np.testing.assert_array_equal(np.asarray(lse[0]), -np.inf)  # no keys: no weight
  np.testing.assert_allclose(np.asarray(o[1:]), np.asarray(o_ref[1:]), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(lse[1:]), np.asarray(lse_ref[1:]), rtol=1e-5, atol=1e-5)


@pytest.mark.numerics
@pytest.mark.parametrize('num_layers', [1, 2])
def test_a_paged_decode_through_the_kernel_equals_the_gathered_one(num_layers):
  """One query a stream over a shared prompt (padded) and its pages: the kernel's pages joined
  by log-sum-exp equal the gathered pages' one softmax; streams in their first page, on a
  page's last slot and further on; the stacked pool's last layer (its pages offset)."""
  rs = np.random.RandomState(1)
  b, hkv, grp, d, g, p, pages, m = 4, 2, 2, 128, 4, 6, 9, 4
  layer = num_layers - 1
  q = _bf16(rs, b, 1, hkv, grp, d)
  prefix_k, prefix_v = _bf16(rs, b, hkv, d, p), _bf16(rs, b, hkv, p, d)
  prefix_mask = jnp.asarray(np.arange(p)[None] >= np.array([[0], [2], [5], [1]]))
  pool_k = _bf16(rs, hkv, num_layers * pages, g, d)
  pool_v = _bf16(rs, hkv, num_layers * pages, g, d)
  index = jnp.asarray([[2], [g - 1], [2 * g + 1], [m * g - 1]], jnp.int32)
  table = jnp.asarray(np.stack([rs.permutation(pages - 1)[:m] for _ in range(b)]), jnp.int32)
  paged = cache_lib.PagedStreams(table + layer * pages, m * g)
  spec = attention_ops.AttentionSpec(
      layout=attention_ops.SharedPrefixDecode(prefix_mask, index), scale=0.125)
  k, v = (prefix_k, pool_k, paged), (prefix_v, pool_v, paged)
  # pylint: disable=protected-access
  gathered = attention_ops._shared_prefix_decode(q, k, v, spec)
  score = functools.partial(attention_ops._prefix_and_streams, lse=True)
  through = attention_paged.decode(q, k, v, spec, score, interpret=True)
  assert through.shape == gathered.shape == (b, 1, hkv, grp, d)
  np.testing.assert_allclose(np.asarray(through), np.asarray(gathered), rtol=2e-5, atol=2e-5)
  # Not a vacuous match: a stream's output moves with its own pages, not with another's.
  first = table[0, 0] + layer * pages
  moved = attention_ops._shared_prefix_decode(
      q, (prefix_k, pool_k.at[:, first].multiply(-1.0), paged), v, spec)
  change = np.abs(np.asarray(moved - gathered)).reshape(b, -1).max(axis=1)
  others = [i for i in range(1, b) if table[0, 0] not in table[i, :index[i, 0] // g + 1]]
  assert change[0] > 1e-2 and others and (change[others] == 0).all(), (change, others)


def _mesh_worker() -> dict:
  """Run as a script on 4 simulated devices: the paged engine on a (data 2, tensor 2) mesh under
  'splash', its decode through the paged kernel, both in Pallas' TPU interpreter, against the
  static sampler on one device."""
  # pylint: disable=import-outside-toplevel
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  from rloo_jax import models, sampler, sampling
  from rloo_jax.models import attention_splash, traced_mesh
  config = models.TransformerConfig.llama(
      vocab_size=48, hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
      intermediate_size=64, max_seq_len=64, dtype='bfloat16', attention='splash')
  graphdef, params = models.create(config)
  fns = models.model_fns(graphdef)
  decode, read, splash = attention_paged.decode, [], []
  run = attention_splash._run  # pylint: disable=protected-access
  attention_splash._run = lambda *a: (splash.append(traced_mesh.shards_vmapped()), run(*a))[1]
  attention_paged.applies = lambda spec: traced_mesh.shards_vmapped() or not traced_mesh.get()
  attention_paged.decode = lambda *a: (
      read.append(traced_mesh.shards_vmapped()), decode(*a, interpret=True))[1]
  lengths = np.array([7, 2, 12, 5], np.int32)
  tokens = np.where(np.arange(12)[None] < lengths[:, None],
                    np.random.RandomState(0).randint(2, 45, (4, 12)), 0).astype(np.int32)
  args = dict(k=2, max_new_tokens=8, method=sampling.Temperature(1.0), eos_id=(45, 46, 47),
              pad_id=0)
  static = sampler.sample(fns, params, tokens, lengths, jax.random.key(3), **args)
  mesh = Mesh(np.asarray(jax.devices()).reshape(2, 1, 2), ('data', 'fsdp', 'tensor'))
  rows = NamedSharding(mesh, P(('data', 'fsdp')))
  with traced_mesh.on_mesh(mesh):
    ours = sampler.sample(fns, params, jax.device_put(tokens, rows),
                          jax.device_put(lengths, rows), jax.random.key(3), slots=4, pages=8,
                          page_size=2, batch_sharding=rows, **args)
  static, ours = jax.tree.map(np.asarray, (static, ours))
  return dict(read=read, splash=splash,
              same_tokens=bool((ours.tokens_bkt == static.tokens_bkt).all()),
              same_lengths=bool((ours.lengths_bk == static.lengths_bk).all()),
              full=int((static.lengths_bk == 8).sum()),
              logprob_diff=float(np.abs(ours.logprobs_bkt - static.logprobs_bkt).max()))


def test_over_a_mesh_each_device_reads_its_own_shards_pages_through_the_kernel():
  """The rollout engine's shards over 'data' (its vmap's spmd_axis_name) and the kv heads over
  'tensor': the paged kernel, and splash in an admission's prefill, run a call a device
  (`traced_mesh.per_shard`) on its own streams and heads, and the engine draws the static
  sampler's tokens."""
  env = dict(os.environ, JAX_PLATFORMS='cpu', XLA_FLAGS=os.environ.get('XLA_FLAGS', '')
             + ' --xla_force_host_platform_device_count=4')
  proc = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  r = json.loads(proc.stdout.strip().splitlines()[-1])
  assert r['read'] == [True], r  # traced once, inside the engine's vmap over its shards
  assert True in r['splash'], r  # an admission's prefill: splash, a call a device
  assert r['same_tokens'] and r['same_lengths'] and r['full'] >= 2, r
  assert r['logprob_diff'] < 4e-3, r


if __name__ == '__main__':
  print(json.dumps(_mesh_worker()))

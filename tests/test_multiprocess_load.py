"""Sharded Hugging Face loading across two processes (jax.distributed on 127.0.0.1, 4 CPU devices
each, one mesh over all 8): each process reads from the files only the slices its own devices
hold, and what they hold equals the host load.

The same two processes check the directories every process must share: a workdir of each
process's own is refused, a compilation cache of each one's own is said in a line.

Both processes run this file as a script (the device count and jax.distributed must be set before
jax starts); each writes what it read and what it checked as JSON, and the test compares them.
"""
import json
import math
import os
import sys

import pytest

from conftest import REPO, TESTS, free_port, run_processes

FIXTURE = os.path.join(TESTS, 'fixtures', 'hf', 'llama')
# fsdp is the mesh's process axis (devices are process-major: process 0 has fsdp index 0), and
# the default rules shard `embed` over it: every tensor with an embed axis is split between the
# processes, the norms (no rule) are replicated on all 8 devices.
MESH = dict(data=1, fsdp=2, tensor=4, rules=[('vocab', 'tensor'), ('embed', 'fsdp'),
                                             ('mlp', 'tensor'), ('q_heads', 'tensor'),
                                             ('kv_heads', 'tensor')])


def _worker(process_id: int, port: int, out_path: str):
  import jax
  from rloo_jax import processes
  started = []
  processes.initialize_distributed(f'127.0.0.1:{port}', 2, process_id, 4, log=started.append)
  fingerprints = list(processes.topology_fingerprints())  # what initialize_distributed read
  from flax import nnx
  import numpy as np
  from rloo_jax import sharding
  from rloo_jax.models import hf, hf_read, transformer

  reads, whole = {}, []  # key -> mask of the raw tensor's elements this process read
  read, call = hf_read._Tensors.read, hf_read._Tensors.__call__

  def recorded_read(self, key, index):
    mask = reads.setdefault(key, np.zeros(self.shape(key), bool))
    assert not mask[index].any(), f'{key} {index}: read twice'  # no replica is read again
    mask[index] = True
    return read(self, key, index)

  def recorded_call(self, key):
    whole.append(key)
    return call(self, key)

  config, want = hf.load_checkpoint(FIXTURE)  # the host load, on this process's first device
  hf_read._Tensors.read, hf_read._Tensors.__call__ = recorded_read, recorded_call
  layout = sharding.make_layout(MESH)
  shardings = layout.tree_shardings(transformer.abstract(config)[1])
  _, got = hf.load_checkpoint(FIXTURE, shardings=shardings)
  mismatch, not_global, held = [], [], 0
  for (k, a), (_, b), (_, s) in zip(*(nnx.to_flat_state(t) for t in (want, got, shardings))):
    a, b = np.asarray(a.get_value()), b.get_value()
    if b.shape != a.shape or b.sharding != s.get_value() or b.is_fully_addressable:
      not_global.append(str(k))
    for shard in b.addressable_shards:
      held += shard.data.size
      if shard.data.dtype != a.dtype or not np.array_equal(np.asarray(shard.data), a[shard.index]):
        mismatch.append(f'{k} on device {shard.device.id}')
  # What this process's devices hold, each distinct block once (a replica is copied, not read).
  blocks = sum(math.prod(b - a for a, b in block) for _, v in nnx.to_flat_state(got)
               for block in _blocks(v.get_value()))
  # The compilation cache: a directory of each process's own (a host's disk), then a shared one.
  from rloo_jax import cli
  root = os.path.dirname(out_path)
  cache_lines = [cli.unshared_cache_line(os.path.join(root, f'own_cache_{process_id}')),
                 cli.unshared_cache_line(os.path.join(root, 'shared_cache')),
                 # process 1's cache off (its directory could not be written): no hang, no line
                 cli.unshared_cache_line('' if process_id else os.path.join(root, 'shared_cache')),
                 cli.unshared_cache_line(os.path.join(root, 'shared_cache') if process_id else '')]
  # A workdir of each process's own: refused on every process before anything is written.
  from conftest import load_config
  from rloo_jax import algorithms
  def refusal(fn, *args):  # the ValueError's message, or None
    try:
      fn(*args)
    except ValueError as e:
      return str(e)
    return None

  own_workdir = os.path.join(root, f'own_workdir_{process_id}')
  config = load_config()
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 2, 2, 2  # test_sharding's two processes
  workdir_error = refusal(lambda: algorithms.run(config, own_workdir, log=lambda *a: None))
  # Process 1 on another config: refused on both, naming the sections. A reward function and a
  # per-host path (its checkpoint's copy on each host) are no difference.
  from rloo_jax import workdir as workdir_lib
  config.rewards.fns = [_worker]
  config.train.compilation_cache_dir = f'/cache/of/host/{process_id}'
  workdir_lib.check_same_config(config)
  config.rloo.k += process_id
  config.train.log_every += process_id
  config_error = refusal(workdir_lib.check_same_config, config)
  real = workdir_lib.versions  # process 1 on another jax (the same config again)
  workdir_lib.versions = lambda: dict(real(), jax='0.0.1') if process_id else real()
  config.rloo.k -= process_id
  config.train.log_every -= process_id
  versions_error = refusal(workdir_lib.check_same_config, config)
  workdir_lib.versions = real  # process 1 on a stale checkout of the same version
  code = workdir_lib.code_digest
  workdir_lib.code_digest = lambda: code() + ('stale' if process_id else '')
  code_error = refusal(workdir_lib.check_same_config, config)
  with open(out_path, 'w') as f:
    owners = [[d.process_index for d in row.reshape(-1)] for row in np.moveaxis(
        layout.mesh.devices, layout.mesh.axis_names.index('fsdp'), 0)]
    json.dump(dict(local=len(jax.local_devices()), num_devices=jax.device_count(), owners=owners,
                   mismatch=mismatch, not_global=not_global, whole=whole, held=held,
                   cache_lines=cache_lines, shared_cache=os.path.join(root, 'shared_cache'),
                   workdir_error=workdir_error, own_workdir=sorted(os.listdir(own_workdir)),
                   config_error=config_error, versions_error=versions_error,
                   code_error=code_error, started=started, fingerprints=fingerprints,
                   cache_on=jax.config.jax_enable_compilation_cache,
                   distinct_block_elements=blocks,
                   read_elements={k: int(m.sum()) for k, m in reads.items()},
                   sizes={k: int(m.size) for k, m in reads.items()},
                   masks={k: np.packbits(m.reshape(-1)).tolist() for k, m in reads.items()}), f)
  jax.distributed.shutdown()


def _blocks(array) -> set:
  """The distinct ((start, stop) per axis) blocks of an array on this process's devices."""
  return {tuple(s.indices(n)[:2] for s, n in zip(index, array.shape))
          for index in array.sharding.addressable_devices_indices_map(array.shape).values()}


@pytest.fixture(scope='module')
def results(tmp_path_factory):
  out = tmp_path_factory.mktemp('multiprocess_load')
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  port = free_port()
  runs = run_processes([[sys.executable, os.path.abspath(__file__), str(i), str(port),
                         str(out / f'{i}.json')] for i in range(2)], env=env, cwd=REPO,
                       timeout=240)
  for returncode, log in runs:
    assert returncode == 0, log[-5000:]
  return [json.loads((out / f'{i}.json').read_text()) for i in range(2)]


def test_each_process_holds_its_devices_blocks_equal_to_the_host_load(results):
  for r in results:
    assert r['local'] == 4 and r['num_devices'] == 8
    assert r['owners'] == [[0] * 4, [1] * 4]  # fsdp index i: process i's devices
    assert r['mismatch'] == [] and r['not_global'] == []


def test_process_0_says_when_another_process_cannot_read_the_compilation_cache(results):
  """JAX writes the cache from process 0 only: with each process's own directory, process 1
  compiles every start. Process 0 says so in one line naming the fix; a shared one is silent."""
  own, shared, one_off, zero_off = results[0]['cache_lines']
  assert own.startswith('[compile] 1 of 2 processes (1) cannot read the compilation cache ')
  assert own.endswith('own_cache_0 (JAX writes it from process 0 only), so they compile every '
                      'program at every start; set --config.train.compilation_cache_dir (or env '
                      'JAX_COMPILATION_CACHE_DIR) to a directory every host reads')
  assert shared is None and results[1]['cache_lines'] == [None] * 4  # process 1 prints nothing
  assert one_off.startswith('[compile] 1 of 2 processes (1) cannot read') and zero_off is None
  assert os.listdir(results[0]['shared_cache']) == []  # the marker is gone


def test_processes_whose_cache_keys_differ_turn_the_cache_off_before_compiling(results):
  """Multi-process XLA:CPU: each process fingerprints the topology differently, so the cache
  keys differ; the cache goes off on both (process 0 says why), as it must on jaxlib 0.12, where a
  loaded program and a compiled one deadlock in their first collective."""
  fingerprints = results[0]['fingerprints']
  assert results[1]['fingerprints'] == fingerprints and len(fingerprints) == 2
  assert fingerprints[0] != fingerprints[1]
  assert not results[0]['cache_on'] and not results[1]['cache_on']
  assert results[0]['started'] == [
      "[compile] compilation cache off for this run: the 2 processes' cache keys differ (each "
      "process's compiler fingerprints the devices' topology differently), so only process 0 "
      "could load a program the others compile anyway"]
  assert results[1]['started'] == []


def test_a_workdir_that_is_not_one_directory_for_all_processes_is_refused_before_any_write(
    results):
  for r in results:  # every process raises (none waits on a collective the other left)
    assert r['workdir_error'].startswith('--workdir ')
    assert r['workdir_error'].endswith(' is not one directory for all processes: 1 of 2 (1) '
                                       'cannot see a file process 0 wrote there; give every '
                                       'process the same --workdir on a filesystem all hosts '
                                       'mount'), r['workdir_error']
    assert r['own_workdir'] == []  # no config, lock, data or marker left


def test_processes_started_with_different_configs_are_refused_naming_the_sections(results):
  for r in results:  # the same line on both: neither is left waiting on the other
    assert r['config_error'] == ("the processes did not start alike: config.rloo, config.train "
                                 "of process(es) 1 differ from process 0's; start every process "
                                 "with the same --config, overrides, library versions and code")


def test_processes_on_other_library_versions_or_code_are_refused(results):
  for r in results:
    assert r['versions_error'].startswith("the processes did not start alike: the library "
                                          "versions of process(es) 1 differ"), r['versions_error']
    assert r['code_error'].startswith("the processes did not start alike: rloo_jax's code of "
                                      "process(es) 1 differ"), r['code_error']


def test_each_process_reads_only_its_devices_slices(results):
  import numpy as np
  for r in results:
    assert r['whole'] == []  # all through slice reads
    # Every element read lands in exactly one distinct block of this process's devices (the
    # llama views map raw elements one to one), so reading more would show as a larger count.
    assert sum(r['read_elements'].values()) == r['distinct_block_elements']
  p0, p1 = results
  assert p0['sizes'] == p1['sizes']
  split = replicated = 0
  for key, size in p0['sizes'].items():
    m0, m1 = (np.unpackbits(np.asarray(r['masks'][key], np.uint8))[:size].astype(bool)
              for r in results)
    assert (m0 | m1).all(), key  # between them the processes read every tensor whole
    if 'norm' in key:  # replicated on every device: each process reads it once
      assert m0.all() and m1.all(), key
      replicated += 1
    else:  # split over fsdp, the process axis: the halves are disjoint
      assert not (m0 & m1).any() and m0.sum() == m1.sum() == size // 2, key
      split += 1
  assert split >= 8 and replicated >= 3


if __name__ == '__main__':
  _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])

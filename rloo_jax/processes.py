"""Starting a multi-process run (jax.distributed): the processes, their devices, and one
persistent compilation cache the processes can share or none.

    multi = processes.initialize_distributed(coordinator, num_processes, process_id)

JAX's persistent-cache key of a program holds the fingerprint of its devices' topology as the
compiler sees it from the process that compiles. Where those fingerprints differ between the
processes (multi-process XLA:CPU), only process 0, the one that writes the cache, could ever load
a program: the others compile every program anyway, and on jaxlib 0.12 a process that loaded a
program and one that compiled it wait on each other forever in their first collective. There
the run turns the cache off before its first compile, said in one line by process 0.
"""

from __future__ import annotations

import functools
import os
from typing import Callable, Optional

import jax


def initialize_distributed(coordinator_address: Optional[str] = None,
                           num_processes: Optional[int] = None,
                           process_id: Optional[int] = None,
                           num_cpu_devices: Optional[int] = None, *,
                           log: Callable[[str], None] = print) -> bool:
  """Starts jax.distributed when a multi-process run is asked for, and returns whether it did;
  call before any jax work. Turns the compilation cache off where the processes' cache keys
  differ (`log`s why on process 0).

  Arguments default to the env vars JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and
  JAX_PROCESS_ID. With none of them set this does nothing (a single-process run), except that
  `num_cpu_devices` still simulates that many CPU devices.
  """
  env = os.environ
  coordinator_address = coordinator_address or env.get("JAX_COORDINATOR_ADDRESS") or None
  if num_processes is None and env.get("JAX_NUM_PROCESSES"):
    num_processes = int(env["JAX_NUM_PROCESSES"])
  if process_id is None and env.get("JAX_PROCESS_ID"):
    process_id = int(env["JAX_PROCESS_ID"])
  if num_cpu_devices:
    jax.config.update("jax_num_cpu_devices", int(num_cpu_devices))
  if coordinator_address is None and num_processes is None:
    return False
  if coordinator_address is None or num_processes is None or process_id is None:
    raise ValueError("a multi-process run needs --coordinator_address, --num_processes and "
                     "--process_id (or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, "
                     "JAX_PROCESS_ID); got "
                     f"{coordinator_address!r}, {num_processes!r}, {process_id!r}")
  jax.distributed.initialize(coordinator_address=coordinator_address,
                             num_processes=int(num_processes), process_id=int(process_id))
  fingerprints = topology_fingerprints()
  if len(set(fingerprints)) > 1:
    jax.config.update("jax_enable_compilation_cache", False)  # before the first compile
    if jax.process_index() == 0:
      log(f"[compile] compilation cache off for this run: the {len(fingerprints)} processes' "
          f"cache keys differ (each process's compiler fingerprints the devices' topology "
          f"differently), so only process 0 could load a program the others compile anyway")
  return True


@functools.cache  # one exchange a run: the store keeps a key once
def topology_fingerprints() -> tuple:
  """Each process's fingerprint of all devices' topology, the part of JAX's persistent-cache key
  that describes the devices (jax/_src/cache_key.py), exchanged through the coordinator's
  key-value store: no compiled program, so no cache read or written before the verdict."""
  # Private names, as orbax's multihost module uses the same client: jax has no public ones.
  from jax._src import distributed  # pylint: disable=import-outside-toplevel
  from jax._src.lib import xla_client  # pylint: disable=import-outside-toplevel

  try:
    mine = str(xla_client.get_topology_for_devices(jax.devices()).fingerprint())
  except jax.errors.JaxRuntimeError:  # no serialized topology: JAX hashes the device list
    mine = "devices"
  client = distributed.global_state.client
  client.key_value_set(f"rloo_jax/topology/{jax.process_index()}", mine)
  return tuple(client.blocking_key_value_get(f"rloo_jax/topology/{i}", 300_000)
               for i in range(jax.process_count()))

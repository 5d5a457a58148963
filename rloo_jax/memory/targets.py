"""Accelerators to plan for without one: the TPU and GPU compilers run on this host, deviceless
(`jax.experimental.topologies`), and hand back devices a mesh is built from. The programs then
compile, and report their memory and cost, as that accelerator's compiler makes them.

    tpu-v5e-8, tpu-v5p-8, tpu-v6e-8  (a power of two of chips; 1 or 2: the first of a 2 x 2 slice)
    h100-8, h200-8                              (GPUs of one host; h100-16 = two hosts of 8)

The compilers come with `pip install -e ".[plan]"` (libtpu; the CUDA plugin, which compiles
without CUDA libraries or a GPU).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import types

import jax

GIB = 2 ** 30


@dataclasses.dataclass(frozen=True)
class Target:
  name: str
  platform: str  # 'tpu' or 'gpu'
  chips: int
  memory_gb: float  # what XLA may allocate per device, GiB
  kind: str  # a readable device name for the table


# HBM per chip, GiB, and how `get_topology_desc` names the family's slices ('2d': a X x Y grid;
# '3d': X x Y x Z, v5p's tori).
_TPU = {"v5e": (16.0, "v5e", "2d"), "v5p": (95.0, "v5", "3d"), "v6e": (32.0, "v6e", "2d")}
# GPU memory, GiB (as the driver reports it), memory bandwidth in bytes/s, and the name the
# device reports. XLA preallocates XLA_PYTHON_CLIENT_MEM_FRACTION of it (default 0.75).
_GPU = {"h100": (79.1, 3_352_320_000_000, "NVIDIA H100 80GB HBM3"),
        "h200": (139.8, 4_800_000_000_000, "NVIDIA H200")}
_GPUS_PER_HOST = 8
NAMES = tuple([f"tpu-{v}-8" for v in _TPU] + [f"{g}-8" for g in _GPU])


def parse(name: str) -> Target:
  """`tpu-<v5e|v5p|v6e>-<chips>` or `<h100|h200>-<gpus>`; ValueError naming the forms."""
  m = re.fullmatch(r"tpu-(v5e|v5p|v6e)-(\d+)|(h100|h200)-(\d+)", name.strip().lower())
  chips = int(m.group(2) or m.group(4)) if m else 0
  if not m or chips < 1 or chips & (chips - 1):
    raise ValueError(f"--target={name!r}: expected tpu-<v5e|v5p|v6e>-<chips> or "
                     f"<h100|h200>-<gpus>, a power-of-two count (e.g. {', '.join(NAMES)})")
  if m.group(1):
    return Target(name, "tpu", chips, _TPU[m.group(1)][0], f"TPU {m.group(1)}")
  gib, _, kind = _GPU[m.group(3)]
  fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75"))
  return Target(name, "gpu", chips, gib * fraction, kind)


def _grid(chips: int, dims: int) -> str:
  """The slice shape of `chips` chips: the most square grid of powers of two."""
  sizes = [1] * dims
  for i in range(int(math.log2(chips))):
    sizes[i % dims] *= 2
  return "x".join(str(s) for s in sorted(sizes))


def gpu_target_config(name: str) -> str:
  """A GpuTargetConfigProto (text form) of one GPU: what the GPU compiler reads instead of
  querying a device. The fields are XLA's target_config/specs/h100_sxm.txtpb's."""
  gib, bandwidth, kind = _GPU[re.match(r"h\d+", name.lower()).group(0)]
  return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {bandwidth}
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: {int(gib * GIB)}
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: 9 minor: 0 }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 1 patch: 0 }}
device_description_str: "{kind}"
"""


def devices(target: Target) -> list:
  """The target's devices, from its compiler run deviceless on this host. Call before anything
  touches a device: the host's own backend is kept to the CPU, so an installed GPU plugin
  neither looks for a GPU nor checks its CUDA libraries. The persistent compilation cache goes
  off for the process: a deviceless compile cannot load a cached executable (each read warns)."""
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_enable_compilation_cache", False)
  try:
    if target.platform == "tpu":
      family = re.match(r"tpu-(\w+)-", target.name.lower()).group(1)
      _, prefix, dims = _TPU[family]
      # The TPU compiler's smallest deviceless slice is one host's 2 x 2 chips: a job of fewer
      # compiles for its first.
      desc = topologies.get_topology_desc(
          f"{prefix}:{_grid(max(target.chips, 4), 2 if dims == '2d' else 3)}", platform="tpu")
    else:
      hosts, per_host = max(target.chips // _GPUS_PER_HOST, 1), min(target.chips, _GPUS_PER_HOST)
      desc = topologies.get_topology_desc(
          topology_name="", platform="cuda", target_config=gpu_target_config(target.name),
          topology=f"1x{hosts}x{per_host}")
  except Exception as e:  # pylint: disable=broad-except
    # No compiler installed for the platform: the plugin's import or registration fails.
    raise ValueError(f"--target={target.name}: the {target.platform.upper()} compiler is not "
                     f"available here ({str(e).splitlines()[0][:200]}); install it with "
                     f"pip install -e \".[plan]\"") from e
  found = list(desc.devices)[:target.chips]
  if len(found) != target.chips:
    raise ValueError(f"--target={target.name}: the compiler gave {len(found)} devices, not "
                     f"{target.chips}")
  return found


def available(platform: str) -> bool:
  """Whether the `platform` ('tpu' or 'gpu') compiler is installed (imports only)."""
  import importlib.util  # pylint: disable=import-outside-toplevel
  module = "libtpu" if platform == "tpu" else "jax_plugins.xla_cuda12"
  try:
    return importlib.util.find_spec(module) is not None
  except ModuleNotFoundError:
    return False


# The TPU compiler's refusal of a program whose temporaries alone exceed the device's memory.
_REFUSAL = re.compile(r"RESOURCE_EXHAUSTED: .*?HLO temporaries \(([0-9.]+)([KMGT])\)")


@dataclasses.dataclass(frozen=True)
class Refused:
  """A program the TPU compiler refused (RESOURCE_EXHAUSTED): the temporaries its refusal
  states stand for its memory (its arguments and outputs unknown, 0), so a plan reports it as
  not fitting, with its advice, instead of failing."""
  temp: int

  def memory_analysis(self):
    return types.SimpleNamespace(argument_size_in_bytes=0, output_size_in_bytes=0,
                                 alias_size_in_bytes=0, temp_size_in_bytes=self.temp)

  def cost_analysis(self):
    return {}

  def as_text(self):
    return ""


def refused(error: Exception) -> Refused:
  """The `Refused` program of a compile `error`; the error itself raised again if it is not a
  refusal for memory."""
  m = _REFUSAL.search(str(error))
  if not m:
    raise error
  return Refused(int(float(m.group(1)) * 1024 ** ("KMGT".index(m.group(2)) + 1)))

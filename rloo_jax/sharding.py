"""Device meshes, logical-axis rules, and the shardings of the train state and of rollout batches.

One code path from one CPU to many hosts: the 1-device run is a (1, 1, 1) mesh, and a run of N
processes (jax.distributed) is the same program with a bigger mesh.

    layout = make_layout(config.mesh)               # checks the mesh against the devices
    state_shardings = layout.tree_shardings(abstract_state)   # params by rules, rest replicated
    tokens = layout.shard_batch(batch["prompt_tokens"])       # this process's rows -> global array

Mesh axes are ('data', 'fsdp', 'tensor'); -1 takes the remaining devices. Devices are laid out in
`jax.devices()` order (process-major), so with the batch sharded over ('data', 'fsdp') -- the two
outer axes -- process i holds rows [i * B / P, (i + 1) * B / P) of every global batch, exactly the
rows `data.pipeline` gives it.

Parameters carry logical axis names (`nnx.with_partitioning`); `config.mesh.rules` maps each name
onto mesh axes. Optimizer moments are `jax.tree.map`s of the params, so they keep the same
metadata and follow their params. A dimension that a mesh axis does not divide is replicated
(logged once), so any model runs on any mesh; pick dims divisible by the mesh for the memory win.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Optional, Sequence

from absl import logging
from flax import nnx
import jax
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
import numpy as np

MESH_AXES = ("data", "fsdp", "tensor")
# The model's logical names (models/transformer.py) plus 'batch' for rollout rows.
LOGICAL_AXES = ("batch", "layers", "vocab", "embed", "q_heads", "kv_heads", "head_dim", "mlp",
                "norm")
DEFAULT_BATCH_AXES = ("data", "fsdp")


# ----------------------------------------------------------------------------------------------
# Config -> mesh and rules (all checks run before anything compiles)


def mesh_shape(mesh_config: Mapping[str, Any], num_devices: int) -> tuple[int, ...]:
  """(data, fsdp, tensor) with a -1 resolved; raises unless the product is `num_devices`."""
  sizes = []
  for name in MESH_AXES:
    value = mesh_config.get(name, 1)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or \
        (value < 1 and value != -1):
      raise ValueError(f"config.mesh.{name} = {value!r}; each mesh axis is a positive integer "
                       "or -1 (the remaining devices)")
    sizes.append(int(value))
  given = ", ".join(f"{n}={s}" for n, s in zip(MESH_AXES, sizes))
  if sizes.count(-1) > 1:
    raise ValueError(f"config.mesh ({given}) has more than one -1; at most one axis may take "
                     "the remaining devices")
  fixed = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if num_devices % fixed:
      raise ValueError(f"config.mesh ({given}): the fixed axes multiply to {fixed}, which does "
                       f"not divide the {num_devices} available devices (jax.device_count())")
    sizes[sizes.index(-1)] = num_devices // fixed
  elif fixed != num_devices:
    raise ValueError(f"config.mesh ({given}) needs {fixed} devices but {num_devices} are "
                     f"available (jax.device_count()); make data * fsdp * tensor = {num_devices}, "
                     "or set one axis to -1")
  return tuple(sizes)


def parse_rules(rules: Sequence[Any]) -> tuple[tuple[str, tuple[str, ...]], ...]:
  """Normalises [(logical, None | 'axis' | ('axis', ...)), ...]; raises on unknown names."""
  out, seen = [], set()
  for i, rule in enumerate(rules or ()):
    try:
      logical, axes = rule
    except (TypeError, ValueError):
      raise ValueError(f"config.mesh.rules[{i}] = {rule!r}; each rule is a pair "
                       "(logical_axis, mesh_axis | (mesh_axes...) | None)") from None
    if logical not in LOGICAL_AXES:
      raise ValueError(f"config.mesh.rules[{i}] names an unknown logical axis {logical!r}; the "
                       f"logical axes are {LOGICAL_AXES}")
    if logical in seen:
      raise ValueError(f"config.mesh.rules names the logical axis {logical!r} twice")
    seen.add(logical)
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    for a in axes:
      if a not in MESH_AXES:
        raise ValueError(f"config.mesh.rules[{i}] maps {logical!r} onto an unknown mesh axis "
                         f"{a!r}; the mesh axes are {MESH_AXES}")
    if len(set(axes)) != len(axes):
      raise ValueError(f"config.mesh.rules[{i}] repeats a mesh axis: {rule!r}")
    out.append((logical, axes))
  return tuple(out)


@dataclasses.dataclass(frozen=True)
class Layout:
  """A mesh and the logical-axis rules: everything needed to place arrays on it."""
  mesh: Mesh
  rules: tuple[tuple[str, tuple[str, ...]], ...]

  # -------------------------------------------------------------------------- properties

  @property
  def shape(self) -> dict[str, int]:
    return dict(self.mesh.shape)

  @property
  def batch_axes(self) -> tuple[str, ...]:
    """Mesh axes of the batch (row) dimension of rollouts and minibatches."""
    return dict(self.rules).get("batch", DEFAULT_BATCH_AXES)

  @property
  def batch_parallelism(self) -> int:
    """How many ways every batch is split: batch sizes must be multiples of this."""
    return math.prod(self.mesh.shape[a] for a in self.batch_axes)

  @property
  def batch_sharding(self) -> NamedSharding:
    """Rows split over the batch axes, every other dimension whole."""
    return NamedSharding(self.mesh, P(self.batch_axes or None))

  @property
  def replicated(self) -> NamedSharding:
    return NamedSharding(self.mesh, P())

  @property
  def platform(self) -> str:
    """'cpu', 'gpu', 'tpu': what the mesh's devices are, so what its programs compile for. Not
    `jax.default_backend()`: a host compiling for a TPU topology has default backend 'cpu'."""
    return self.mesh.devices.flat[0].platform

  # -------------------------------------------------------------------------- parameters

  def spec(self, names: Sequence[Optional[str]], shape: Sequence[int],
           without: Sequence[str] = ()) -> P:
    """PartitionSpec of an array with logical axis `names`; non-dividing axes are dropped, and
    so are the mesh axes in `without`."""
    rules = dict(self.rules)
    used, entries = set(without), []
    for name, size in zip(names, shape):
      axes = tuple(a for a in rules.get(name, ()) if a not in used and self.mesh.shape[a] > 1)
      ways = math.prod(self.mesh.shape[a] for a in axes)
      if axes and size % ways:
        _warn_once(f"dimension {name!r} of size {size} is not divisible by mesh axes {axes} "
                   f"({ways} ways); replicating it")
        axes = ()
      used.update(axes)
      entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    while entries and entries[-1] is None:
      entries.pop()
    return P(*entries)

  def tree_shardings(self, tree: Any, without: Sequence[str] = ()) -> Any:
    """NamedShardings for a pytree of (abstract) arrays: nnx Variables with logical names by
    the rules, every other leaf replicated. Same structure as `tree` (a valid jit prefix).

    `without=('fsdp',)` gives the layout parameters are *used* in: gathered over fsdp, still
    split over tensor (see `param_gather`)."""
    def one(x):
      if isinstance(x, nnx.Variable):
        leaf = jax.tree.leaves(x)[0]
        names = _logical_names(x) or (None,) * len(leaf.shape)
        return x.replace(NamedSharding(self.mesh, self.spec(names, leaf.shape, without)))
      return self.replicated
    return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))

  def param_gather(self, params: Any) -> Optional["ParamGather"]:
    """FSDP, layer by layer: the `ParamGather` the model functions apply (models.model_fns),
    or None when fsdp is 1 (nothing to gather). Parameters are stored split over fsdp but
    gathered for compute, so activations stay split by rows (data x fsdp): without the explicit
    gather XLA propagates the fsdp split of the kernels into the activations and
    rematerialises them."""
    if self.mesh.shape["fsdp"] == 1:
      return None
    return ParamGather.of(self.tree_shardings(params),
                          self.tree_shardings(params, without=("fsdp",)))

  def abstract(self, tree: Any, shardings: Any = None) -> Any:
    """ShapeDtypeStructs carrying shardings (an Orbax restore target, a lowering argument)."""
    shardings = self.tree_shardings(tree) if shardings is None else shardings
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        tree, shardings)

  def put(self, tree: Any, shardings: Any) -> Any:
    """Places a pytree of host or device values (the same on every process) onto `shardings`."""
    if jax.process_count() == 1:
      return jax.device_put(tree, shardings)

    def one(x, s):
      if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return jax.device_put(x, s)  # a global array: reshard in place
      x = np.asarray(x)
      return jax.make_array_from_callback(x.shape, s, lambda idx: x[idx])
    return jax.tree.map(one, tree, shardings)

  def replicate_unplaced(self, tree: Any) -> Any:
    """Leaves not on a mesh (a step or optimizer counter made eagerly, on one device) replicated
    onto this one, where a jitted step returns them: else the step compiles again, for its own
    outputs. Leaves already placed stay as they are, uncopied."""
    return jax.tree.map(lambda x: x if isinstance(getattr(x, "sharding", None), NamedSharding)
                        else self.put(x, self.replicated), tree)

  # -------------------------------------------------------------------------- batches

  def shard_batch(self, x) -> jax.Array:
    """This process's rows (host numpy) -> the global array, rows split over the batch axes."""
    x = np.asarray(x)
    if jax.process_count() == 1:
      return jax.device_put(x, self.batch_sharding)
    return multihost_utils.host_local_array_to_global_array(x, self.mesh, P(self.batch_axes))

  def reshard_batch(self, x: jax.Array) -> jax.Array:
    """A device array -> rows split over the batch axes (a no-op when already so)."""
    return jax.device_put(x, self.batch_sharding)

  def put_global_batch(self, x) -> jax.Array:
    """A host array holding the *global* batch (the same on every process) -> sharded rows."""
    return self.put(np.asarray(x), self.batch_sharding)

  def gather(self, x) -> np.ndarray:
    """The full value of a (possibly multi-process) array, on every process."""
    if jax.process_count() == 1 or (isinstance(x, jax.Array) and x.is_fully_replicated):
      return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))

  def gather_rows(self, x_local) -> np.ndarray:
    """Concatenates every process's host rows (process order = global row order)."""
    x_local = np.asarray(x_local)
    if jax.process_count() == 1:
      return x_local
    return np.asarray(multihost_utils.process_allgather(x_local, tiled=True))

  def local_rows(self, x: jax.Array) -> np.ndarray:
    """This process's rows of a global batch-sharded array, as host numpy."""
    if jax.process_count() == 1:
      return np.asarray(x)
    x = self.reshard_batch(x)
    return np.asarray(multihost_utils.global_array_to_host_local_array(
        x, self.mesh, P(self.batch_axes)))


@dataclasses.dataclass(frozen=True, eq=False)
class ParamGather:
  """Where FSDP-sharded parameters are gathered for compute: the embedding and head once per
  program (`params`), each layer's weights inside the layer scan (`layer`), so at most one
  layer is held gathered at a time (XLA frees it before the next) instead of the whole tree.

  Each gather first pins the stored (sharded) layout and then the gathered one: the transpose
  of a sharding constraint constrains the cotangent the same way, so the backward pass
  reduce-scatters every layer's gradient as soon as it is computed instead of holding a whole
  gathered gradient. Hashable by identity (a static argument of the model functions).
  """
  top: Mapping[str, tuple]  # path of a non-layer leaf -> (stored, gathered) sharding
  per_layer: Mapping[str, tuple]  # path inside one layer -> (stored, gathered), layer axis gone

  @classmethod
  def of(cls, stored: Any, gathered: Any) -> "ParamGather":
    top, per_layer = {}, {}
    pairs = zip(_leaves_with_paths(stored), jax.tree.leaves(gathered))
    for (path, s), g in pairs:
      if path and getattr(path[0], "key", None) == "layers":
        drop = lambda x: NamedSharding(x.mesh, P(*x.spec[1:]))
        per_layer[jax.tree_util.keystr(path[1:])] = (drop(s), drop(g))
      else:
        top[jax.tree_util.keystr(path)] = (s, g)
    return cls(top, per_layer)

  @staticmethod
  def _apply(tree, table):
    def one(path, x):
      key = jax.tree_util.keystr(path)
      if key not in table:
        return x
      stored, gathered = table[key]
      return jax.lax.with_sharding_constraint(jax.lax.with_sharding_constraint(x, stored),
                                              gathered)
    return jax.tree_util.tree_map_with_path(one, tree)

  def params(self, tree: Any) -> Any:
    """The non-layer parameters of `tree` (a params state, or a dict of its top-level entries)
    gathered; the stacked layers left as stored."""
    return self._apply(tree, self.top)

  def layer(self, tree: Any) -> Any:
    """One layer's weights (a slice of the stacked layers) gathered."""
    return self._apply(tree, self.per_layer)


def _leaves_with_paths(tree):
  return jax.tree_util.tree_flatten_with_path(tree)[0]


def make_layout(mesh_config: Mapping[str, Any], devices: Optional[Sequence[Any]] = None) -> Layout:
  """The mesh of `mesh_config` (config.mesh) over `devices` (default: all, process-major)."""
  devices = list(jax.devices() if devices is None else devices)
  shape = mesh_shape(mesh_config, len(devices))
  rules = parse_rules(mesh_config.get("rules", ()))
  mesh = Mesh(np.asarray(devices, dtype=object).reshape(shape), MESH_AXES,
              axis_types=(AxisType.Auto,) * len(MESH_AXES))
  layout = Layout(mesh, rules)
  if jax.process_count() > 1 and layout.batch_parallelism % jax.process_count():
    raise ValueError(f"the batch is split {layout.batch_parallelism} ways (mesh axes "
                     f"{layout.batch_axes}) across {jax.process_count()} processes; every process "
                     "must own whole batch shards, so make data * fsdp a multiple of the process "
                     "count")
  return layout


def leading_ways(named) -> int:
  """How many ways a NamedSharding (None: 1) splits its leading axis."""
  if named is None or not len(named.spec) or named.spec[0] is None:
    return 1
  axes = named.spec[0]
  return math.prod(named.mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))


def check_batch(name: str, size: int, layout: Layout) -> None:
  """Raises unless a batch of `size` rows splits evenly over the batch axes and the processes."""
  ways = layout.batch_parallelism
  if size % ways:
    raise ValueError(f"{name} = {size} is not divisible by the batch parallelism "
                     f"{ways} (mesh axes {' x '.join(layout.batch_axes)} = "
                     f"{' x '.join(str(layout.mesh.shape[a]) for a in layout.batch_axes)}); "
                     f"choose a multiple of {ways} or a smaller data/fsdp")
  if size % jax.process_count():
    raise ValueError(f"{name} = {size} is not divisible by the {jax.process_count()} processes")


# ----------------------------------------------------------------------------------------------
# Helpers


def _logical_names(variable) -> Optional[tuple]:
  md = variable.get_metadata()
  for key in ("out_sharding", "sharding_names", "sharding"):
    names = md.get(key)
    if names:
      return tuple(names)
  return None


_WARNED: set = set()


def _warn_once(message: str) -> None:
  if message not in _WARNED:
    _WARNED.add(message)
    logging.warning("sharding: %s", message)


def per_device_bytes(tree: Any) -> int:
  """Bytes one device holds of a pytree of sharded (abstract or concrete) arrays (the max)."""
  per_device: dict[Any, int] = {}
  for x in jax.tree.leaves(tree):
    sharding = x.sharding
    item = np.dtype(x.dtype).itemsize
    for device, index in sharding.devices_indices_map(tuple(x.shape)).items():
      n = math.prod(len(range(*s.indices(d))) for s, d in zip(index, x.shape)) if index else 1
      per_device[device] = per_device.get(device, 0) + n * item
  return max(per_device.values()) if per_device else 0

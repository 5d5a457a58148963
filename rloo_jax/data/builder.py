"""tensorflow-datasets plumbing shared by every task builder (arithmetic, summarize, TL;DR, HH).

Why tfds without TensorFlow: a `GeneratorBasedBuilder` written as array_record gives a versioned,
cached, random-access dataset (`as_data_source`) that grain pipelines index; only tfrecord
reading (`tfds.as_numpy`, `as_dataset`) needs TensorFlow, and nothing here calls it.

A task subclasses `TextBuilder`, names its string/int fields, turns its keyword options into a
`BuilderConfig` (whose name encodes every option, so two option sets never share a cache directory)
and yields plain dicts per split. The base class keeps record order (`disable_shuffling`, so a seed
fully determines the data), numbers the keys, and records per-split kept/dropped counts in the
dataset's metadata.json, where they survive for whoever reads the prepared directory later.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import io
import logging as std_logging
import os
from typing import Any, Iterable, Mapping

from absl import logging
import numpy as np
import tensorflow_datasets as tfds

ARRAY_RECORD = "array_record"


class _DropCustomConfigWarning(std_logging.Filter):

  def filter(self, record):
    return not str(record.msg).startswith("Using custom data configuration")


@contextlib.contextmanager
def _quiet_custom_config_warning():
  logger = std_logging.getLogger("absl")
  f = _DropCustomConfigWarning()
  logger.addFilter(f)
  try:
    yield
  finally:
    logger.removeFilter(f)


class _LocalInfo(tfds.core.DatasetInfo):
  """The info of a dataset generated here, which is never in tfds's GCS bucket: its lookup there
  (on every builder of a dataset not yet prepared) made a temp dir it never removed."""

  def initialize_from_bucket(self) -> None:
    pass


class TextBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """Base class: subclasses set TEXT_FIELDS / INT_FIELDS and implement `make_config` and
  `_split_examples`."""

  VERSION = tfds.core.Version("1.0.0")
  TEXT_FIELDS: tuple[str, ...] = ()
  INT_FIELDS: tuple[str, ...] = ()
  DESCRIPTION = ""

  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls):
    # tfds looks for a checksums file beside the builder's source, and the lookup needs the
    # undeclared package importlib_resources; our downloads are pinned by URL, not checksums.
    return None

  def __init__(self, *, data_dir: str | os.PathLike | None = None,
               file_format: str = ARRAY_RECORD, config: tfds.core.BuilderConfig | None = None,
               **options):
    if config is None:
      config = self.make_config(**options)
    elif options:
      raise TypeError(f"{type(self).__name__}: pass either config= or options, not both "
                      f"(got {sorted(options)})")
    self._stats: dict[str, collections.Counter] = {}
    # Every config here is built from options rather than listed in BUILDER_CONFIGS, which tfds
    # would otherwise report as a warning on each construction.
    with _quiet_custom_config_warning():
      super().__init__(data_dir=data_dir, config=config, file_format=file_format)

  @classmethod
  def make_config(cls, **options) -> tfds.core.BuilderConfig:
    raise NotImplementedError

  def _split_examples(self, dl_manager) -> Mapping[str, Iterable[dict[str, Any]]]:
    """Returns {split name: iterable of example dicts}; iterables are consumed lazily."""
    raise NotImplementedError

  def _info(self) -> tfds.core.DatasetInfo:
    features = {f: tfds.features.Text() for f in self.TEXT_FIELDS}
    features.update({f: tfds.features.Tensor(shape=(), dtype=np.int64) for f in self.INT_FIELDS})
    return _LocalInfo(
        builder=self,
        description=self.DESCRIPTION,
        features=tfds.features.FeaturesDict(features),
        disable_shuffling=True,
        metadata=tfds.core.MetadataDict(),
    )

  def _split_generators(self, dl_manager):
    return {split: self._generate_examples(split=split, examples=examples)
            for split, examples in self._split_examples(dl_manager).items()}

  def count(self, split: str, what: str, n: int = 1) -> None:
    """Records `n` events (e.g. 'dropped_too_long') for a split; saved in metadata['stats']."""
    self._stats.setdefault(split, collections.Counter())[what] += n

  def _generate_examples(self, split, examples):
    kept = 0
    for ex in examples:
      yield f"{kept:010d}", ex
      kept += 1
    self.count(split, "kept", kept)
    stats = {s: dict(c) for s, c in self._stats.items()}
    self.info.metadata["stats"] = stats
    logging.info("%s/%s split %r: %s", self.name, self.builder_config.name, split,
                 dict(self._stats[split]))


def prepare(builder_cls: type[TextBuilder], data_dir: str | os.PathLike, *,
            progress: bool = False, **options) -> TextBuilder:
  """Builds (once; later calls reuse the cache) and returns the prepared builder.

  tfds's progress bars are off unless `progress`: the embedded tasks build in well under a second
  and the bars would interleave with the trainer's console output. tfds's own "Downloading and
  preparing dataset ... Unknown size" lines are replaced by one line that says what happens:
  these datasets are generated locally, nothing is downloaded.
  """
  from tensorflow_datasets.core.utils import tqdm_utils
  builder = builder_cls(data_dir=os.fspath(data_dir), **options)
  if os.path.exists(os.path.join(builder.data_dir, "dataset_info.json")):
    builder.download_and_prepare()  # a no-op on a prepared dataset: it only loads its info
    return builder
  print(f"[data] generating {builder.name} ({builder.builder_config.name}) in {builder.data_dir}",
        flush=True)
  was_active = tqdm_utils._active  # pylint: disable=protected-access
  tfds.display_progress_bar(progress)
  try:
    with contextlib.redirect_stdout(io.StringIO()):
      builder.download_and_prepare()
  finally:
    tfds.display_progress_bar(was_active)
  return builder


def stats(builder_or_dir) -> dict[str, dict[str, int]]:
  """Per-split counts ('kept', 'dropped_*', ...) recorded when the dataset was prepared."""
  builder = _as_builder(builder_or_dir)
  return dict(builder.info.metadata.get("stats", {})) if builder.info.metadata else {}


def _as_builder(builder_or_dir):
  if isinstance(builder_or_dir, tfds.core.DatasetBuilder):
    return builder_or_dir
  path = os.fspath(builder_or_dir)
  if not os.path.exists(os.path.join(path, "dataset_info.json")):
    raise FileNotFoundError(f"{path} is not a prepared tfds dataset directory "
                            "(no dataset_info.json); prepare it with rloo_jax.data.builder.prepare")
  return tfds.builder_from_directory(path)


class TextSource:
  """Random-access view of a prepared split with text decoded to `str` and scalars to Python.

  tfds data sources return Text features as bytes; decoding here keeps every consumer (pipeline,
  reward functions, JSON logs) on plain strings.
  """

  def __init__(self, data_source, name: str = ""):
    self._source = data_source
    self.name = name

  def __len__(self) -> int:
    return len(self._source)

  @staticmethod
  def _decode(record: Mapping[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in record.items():
      if isinstance(v, bytes):
        v = v.decode("utf-8")
      elif isinstance(v, np.generic):
        v = v.item()
      elif isinstance(v, np.ndarray) and v.ndim == 0:
        v = v.item()
      out[k] = v
    return out

  def __getitem__(self, index: int) -> dict[str, Any]:
    n = len(self)
    if not -n <= index < n:
      raise IndexError(f"index {index} out of range for {self.name or 'source'} of {n} records")
    return self._decode(self._source[int(index) % n])

  def __getitems__(self, indices) -> list[dict[str, Any]]:
    indices = [int(i) for i in indices]
    if hasattr(self._source, "__getitems__"):
      return [self._decode(r) for r in self._source.__getitems__(indices)]
    return [self[i] for i in indices]

  def __repr__(self):
    return f"TextSource({self.name!r}, {len(self)} records)"


def load_split(builder_or_dir, split: str) -> TextSource:
  """A prepared builder, or the directory it was prepared into (…/name/config/version), as a
  `TextSource` for `split`."""
  builder = _as_builder(builder_or_dir)
  if split not in builder.info.splits:
    raise KeyError(f"split {split!r} not in {builder.name}; available: "
                   f"{sorted(builder.info.splits)}")
  return TextSource(builder.as_data_source(split=split), name=f"{builder.name}:{split}")


def config_name(**options) -> str:
  """A directory-safe config name that encodes every option value."""
  parts = []
  for k in sorted(options):
    v = options[k]
    if isinstance(v, (list, tuple)):
      v = "+".join(str(x) for x in v)
    v = str(v)
    if len(v) > 32:  # keeps directory names short; the digest still tells option sets apart
      v = "h" + hashlib.sha1(v.encode("utf-8")).hexdigest()[:12]
    parts.append(f"{k}={v}")
  name = "_".join(parts)
  return "".join(c if c.isalnum() or c in "=_+-." else "-" for c in name)


def builder_config(cls: type, **options) -> tfds.core.BuilderConfig:
  """Instantiates a BuilderConfig dataclass `cls` with a name derived from its own fields."""
  fields = {f.name for f in dataclasses.fields(cls)} - {
      f.name for f in dataclasses.fields(tfds.core.BuilderConfig)}
  unknown = set(options) - fields
  if unknown:
    raise TypeError(f"{cls.__name__}: unknown option(s) {sorted(unknown)}; known: {sorted(fields)}")
  cfg = cls(name="tmp", **options)
  named = {f: getattr(cfg, f) for f in sorted(fields) if not f.startswith("_")}
  excluded = getattr(cfg, "NAME_EXCLUDES", ())
  return dataclasses.replace(cfg, name=config_name(**{k: v for k, v in named.items()
                                                      if k not in excluded}))


# Helpers for builders that parse downloaded files (TL;DR, HH).


def open_text(path) -> Any:
  """Opens a text file, transparently gunzipping (by content, since downloads lose extensions)."""
  import gzip
  path = os.fspath(path)
  with open(path, "rb") as f:
    magic = f.read(2)
  if magic == b"\x1f\x8b":
    return gzip.open(path, "rt", encoding="utf-8")
  return open(path, encoding="utf-8")


def read_json_lines(path, label: str | None = None):
  """Yields `(where, obj)` per non-blank line; `where` is 'file:line' for error messages."""
  import json
  label = label or os.fspath(path)
  if not os.path.isfile(os.fspath(path)):
    raise FileNotFoundError(f"{label}: file not found")
  with open_text(path) as f:
    for lineno, line in enumerate(f, start=1):
      if not line.strip():
        continue
      where = f"{label}:{lineno}"
      try:
        obj = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None
      if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
      yield where, obj


def field(obj: Mapping[str, Any], path: str, where: str, kind: type | tuple[type, ...] = str):
  """`obj['a']['b']` for path 'a.b' (list items by number: 'summaries.0.text'), with an error
  naming the file, line and field when it is missing or of the wrong type."""
  cur: Any = obj
  for part in path.split("."):
    if isinstance(cur, list) and part.isdigit() and int(part) < len(cur):
      cur = cur[int(part)]
    elif isinstance(cur, dict) and part in cur:
      cur = cur[part]
    else:
      raise ValueError(f"{where}: missing field {path!r}")
  if not isinstance(cur, kind) or isinstance(cur, bool) and kind is not bool:
    names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
    raise ValueError(f"{where}: field {path!r} should be {names}, got {type(cur).__name__}")
  return cur


def token_counter(tokenizer) -> tuple[Any, str]:
  """`(count(text) -> int, name)`; None means UTF-8 bytes, an upper bound on any BPE's count.

  The name goes into the config name, so data filtered with different tokenizers never shares a
  cache directory.
  """
  if tokenizer is None:
    return (lambda text: len(text.encode("utf-8"))), "bytes"
  name = getattr(tokenizer, "name", None) or getattr(tokenizer, "name_or_path", None) \
      or type(tokenizer).__name__
  return (lambda text: len(tokenizer.encode(text))), str(name)


def resolve_files(dl_manager, source_dir, relative: Mapping[str, str], base_url: str):
  """{key: local path}: from `source_dir` (offline: the sources' own file layout) if given, else
  downloaded from `base_url` + relative path by the tfds download manager (cached under
  data_dir/downloads)."""
  if source_dir:
    out = {}
    for key, rel in relative.items():
      path = os.path.join(os.fspath(source_dir), rel)
      if not os.path.isfile(path) and rel.endswith(".gz") and os.path.isfile(path[:-3]):
        path = path[:-3]  # accept an already-unzipped copy
      if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: file not found (expected the source's file {rel!r} "
                                f"under source_dir={os.fspath(source_dir)!r})")
      out[key] = path
    return out
  paths = dl_manager.download({key: base_url + rel for key, rel in relative.items()})
  return {key: os.fspath(p) for key, p in paths.items()}

"""Where a checkpoint lives: a local directory as it is, or a Hugging Face hub id resolved
through huggingface_hub's cache (`resolve_path`), shared by the import (hf) and the export
(hf_export) without either importing the other."""

from __future__ import annotations

import os
import re


# What snapshot_download fetches: the config, the weights and the tokenizer files, nothing else
# (repos often also hold pytorch_model.bin, ONNX or GGUF copies many times the size).
HUB_PATTERNS = ('config.json', 'generation_config.json', '*.safetensors',
                'model.safetensors.index.json', 'tokenizer.json', 'tokenizer_config.json',
                'special_tokens_map.json')
# 'org/name': exactly one slash, no leading '/', '.' or '~' (those are paths).
_REPO_ID = re.compile(r'^[A-Za-z0-9][\w\-.]*/[\w\-.]+$')


def _env_true(name: str) -> bool:
  return os.environ.get(name, '').strip().upper() in ('1', 'ON', 'YES', 'TRUE')


def _hub_cache_dir() -> str | None:
  """HF_HUB_CACHE, else $HF_HOME/hub, read now: huggingface_hub.constants reads them once at its
  import, so a process (or a test) that sets them later would otherwise be ignored."""
  if os.environ.get('HF_HUB_CACHE'):
    return os.path.expanduser(os.environ['HF_HUB_CACHE'])
  if os.environ.get('HF_HOME'):
    return os.path.join(os.path.expanduser(os.environ['HF_HOME']), 'hub')
  return None  # huggingface_hub's own default (~/.cache/huggingface/hub)


def resolve_path(path_or_id: str, *, what: str = 'config.model.init_from') -> str:
  """A local checkpoint directory for a local path or a Hugging Face hub id.

  A local directory passes through unchanged. Anything else that looks like 'org/name' is
  fetched with huggingface_hub.snapshot_download (HUB_PATTERNS only) into the hub cache, or read
  from that cache when HF_HUB_OFFLINE=1; the snapshot directory is returned. Otherwise a
  FileNotFoundError naming `what` (the setting the value came from) and the fix.
  """
  path = os.path.expanduser(str(path_or_id))
  if os.path.isdir(path):
    return path
  if not _REPO_ID.match(path) or os.path.exists(path):
    raise FileNotFoundError(
        f'{what}={path_or_id!r} is not a directory; point it at a local Hugging Face '
        "checkpoint (config.json + model.safetensors) or a hub id 'org/name'")
  try:
    # Only for hub ids: local checkpoints never import it.
    from huggingface_hub import constants as hub_constants, snapshot_download
  except ImportError as e:
    raise FileNotFoundError(f'{what}={path_or_id!r} is not a local directory, and loading it as '
                            'a hub id needs huggingface_hub (pip install huggingface_hub)') from e
  # Read at call time, like the cache directory: constants.HF_HUB_OFFLINE is fixed at import.
  offline = _env_true('HF_HUB_OFFLINE') or _env_true('TRANSFORMERS_OFFLINE') or bool(
      hub_constants.HF_HUB_OFFLINE)
  try:
    return snapshot_download(path, cache_dir=_hub_cache_dir(), allow_patterns=list(HUB_PATTERNS),
                             local_files_only=offline)
  except Exception as e:  # pylint: disable=broad-except  (offline miss, 404, gated, no network)
    hint = ('HF_HUB_OFFLINE is set and it is not in the hub cache '
            f'({_hub_cache_dir() or hub_constants.HF_HUB_CACHE}); download it once '
            'online, or unset HF_HUB_OFFLINE' if offline else
            'the hub could not serve it (check the id, your network and, for a gated repo, '
            'HF_TOKEN)')
    raise FileNotFoundError(f'{what}={path_or_id!r} is not a local directory and could not be '
                            f'loaded as a Hugging Face hub id: {hint} ({type(e).__name__}: '
                            f'{" ".join(str(e).split())[:300]})') from e  # one line

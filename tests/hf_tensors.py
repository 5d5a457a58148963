"""Reading back a Hugging Face checkpoint directory in tests."""
import os

import numpy as np


def iter_tensors(out_dir: str):
  """(name, float32 array) of every tensor of an HF checkpoint directory."""
  from safetensors import safe_open

  for fname in sorted(f for f in os.listdir(out_dir) if f.endswith('.safetensors')):
    with safe_open(os.path.join(out_dir, fname), framework='flax') as f:
      for key in f.keys():
        yield key, np.asarray(f.get_tensor(key), np.float32)

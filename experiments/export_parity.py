r"""Exported checkpoints against transformers (docs/EXPORT.md): every committed HF fixture, its
weights perturbed, exported in float32 and bfloat16 by `hf_export.save_pretrained` (this
interpreter, jax), loaded by AutoModelForCausalLM in the TRL venv (torch) with its missing /
unexpected keys, its logits compared with ours on the fixture's right- and left-padded batches;
each export's tokenizer must load as the source's class with its ids (`--write_reference` stores
them in tests/fixtures/export_tokenizers.json for tests/test_export.py). One JSON line an export.

    python experiments/export_parity.py [--trl_python .venv-trl/bin/python] [--out /tmp/parity]
"""
import argparse
import json
import os
import shutil
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(os.path.dirname(HERE), "tests", "fixtures", "hf")
DTYPES = ("float32", "bfloat16")
REFERENCE = os.path.join(os.path.dirname(HERE), "tests", "fixtures", "export_tokenizers.json")
PROMPT = "Summarize: the cat sat on the mat, then 12 + 30 = 42.\nTL;DR:"


def export_side(out_root):
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from rloo_jax.models import hf, hf_export, transformer  # pylint: disable=import-outside-toplevel

  for fam in sorted(f for f in os.listdir(FIXTURES) if os.path.isdir(os.path.join(FIXTURES, f))):
    src = os.path.join(FIXTURES, fam)
    config, graphdef, params = hf.load_model(src)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(7), len(leaves))
    params = jax.tree.unflatten(treedef, [x + 0.05 * jax.random.normal(k, x.shape)
                                          for x, k in zip(leaves, keys)])
    ref = np.load(os.path.join(src, "reference.npz"))
    fns = transformer.model_fns(graphdef)
    for dtype in DTYPES:
      out = os.path.join(out_root, f"{fam}_{dtype}")
      shutil.rmtree(out, ignore_errors=True)
      hf_export.save_pretrained(params, config, out, dtype=dtype, tokenizer_dir=src)
      rounded = params if dtype == "float32" else jax.tree.map(
          lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), params)
      ours = {f"{side}_{k}": ref[f"{side}_{k}"] for side in ("right", "left")
              for k in ("tokens", "positions", "mask")}
      for side in ("right", "left"):
        ours[f"{side}_logits"] = np.asarray(fns.forward(
            rounded, *(ref[f"{side}_{k}"] for k in ("tokens", "positions", "mask"))))
      np.savez(os.path.join(out, "rloo_jax_logits.npz"), **ours)


def tokenizer_side(out_root, write_reference: bool):
  """The export's tokenizer against the source's, in transformers: class and ids."""
  import transformers  # pylint: disable=import-outside-toplevel
  reference = {}
  for name in sorted(os.listdir(out_root)):
    fam, dtype = name.rsplit("_", 1)
    if dtype != "float32":
      continue
    source = transformers.AutoTokenizer.from_pretrained(os.path.join(FIXTURES, fam))
    export = transformers.AutoTokenizer.from_pretrained(os.path.join(out_root, name))
    # Without special tokens: the ids rloo_jax's own tokenizer gives (the pipeline adds bos).
    ids = source(PROMPT, add_special_tokens=False)["input_ids"]
    same = (type(export) is type(source) and export(PROMPT)["input_ids"] == source(PROMPT)[
        "input_ids"] and export(PROMPT, add_special_tokens=False)["input_ids"] == ids)
    print(json.dumps({"family": fam, "tokenizer": type(source).__name__,
                      "export_tokenizer": type(export).__name__, "same_class_and_ids": same}),
          flush=True)
    if not same:
      raise SystemExit(f"{fam}: the export's tokenizer differs from the source's")
    reference[fam] = {"tokenizer_class": type(source).__name__, "ids": list(ids)}
  if write_reference:
    with open(REFERENCE, "w") as f:
      json.dump({"prompt": PROMPT, "transformers": transformers.__version__,
                 "families": reference}, f, indent=1)
      f.write("\n")


def torch_side(out_root):
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel

  for name in sorted(os.listdir(out_root)):
    out = os.path.join(out_root, name)
    if not os.path.isfile(os.path.join(out, "rloo_jax_logits.npz")):
      continue
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, output_loading_info=True)
    ours = np.load(os.path.join(out, "rloo_jax_logits.npz"))
    worst = 0.0
    for side in ("right", "left"):
      mask = ours[f"{side}_mask"]
      with torch.no_grad():
        got = model(input_ids=torch.tensor(ours[f"{side}_tokens"], dtype=torch.long),
                    attention_mask=torch.tensor(mask.astype(np.int64)),
                    position_ids=torch.tensor(ours[f"{side}_positions"], dtype=torch.long)
                    ).logits.numpy()
      worst = max(worst, float(np.abs(got[mask] - ours[f"{side}_logits"][mask]).max()))
    fam, dtype = name.rsplit("_", 1)
    print(json.dumps({"family": fam, "dtype": dtype, "architecture": type(model).__name__,
                      "max_abs_logit_diff": worst,
                      "logit_scale": float(np.abs(ours["right_logits"]).max()),
                      "loading_problems": {k: v for k, v in info.items() if v},
                      "transformers": transformers.__version__}), flush=True)


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--trl_python", default=os.path.join(HERE, "..", ".venv-trl", "bin", "python"))
  p.add_argument("--out", default="/tmp/rloo_jax_export_parity")
  p.add_argument("--side", default="both", choices=("both", "torch"))
  p.add_argument("--write_reference", action="store_true",
                 help=f"store each family's tokenizer class and prompt ids in {REFERENCE}")
  args = p.parse_args()
  if args.side == "torch":
    torch_side(args.out)
    return tokenizer_side(args.out, args.write_reference)
  export_side(args.out)
  subprocess.run([args.trl_python, os.path.abspath(__file__), "--side", "torch", "--out",
                  args.out] + (["--write_reference"] if args.write_reference else []), check=True)
  return None


if __name__ == "__main__":
  sys.exit(main())

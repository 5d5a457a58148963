"""Variance of the RLOO policy-gradient estimate as k grows, on an enumerable toy policy.

Prints one JSON line. For each k: the total variance (trace of the covariance) of one prompt's
gradient estimate, the same per sample (variance * k, for comparison at an equal sample budget), and
the bias check: the projection of the mean estimate on the exact gradient (1.0 = unbiased), for RLOO
and for the mean baseline that includes each sample in its own baseline (expected (k-1)/k).

    python experiments/variance_k.py
    python experiments/variance_k.py --groups 200000 --seed 3
"""
import argparse
import json
import time

import numpy as np

from rloo_jax.toy import ToyPolicy, estimator_statistics


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--groups", type=int, default=100_000, help="gradient estimates per k")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--ks", default="2,4,8")
  args = parser.parse_args()
  policy = ToyPolicy(vocab=3, length=3, seed=0)
  start = time.time()
  out = {"policy": "toy vocab=3 length=3 (27 sequences)", "groups": args.groups,
         "seed": args.seed, "k": {}}
  for k in (int(x) for x in args.ks.split(",")):
    rloo = estimator_statistics(policy, k, args.groups, seed=args.seed)
    shrunk = estimator_statistics(policy, k, args.groups, seed=args.seed,
                                  estimator="mean_baseline")
    used = rloo["stderr"] > 0
    z = np.abs(rloo["mean"] - rloo["exact"])[used] / rloo["stderr"][used]
    out["k"][k] = {
        "variance": round(rloo["variance"], 6),
        "variance_x_k": round(rloo["variance"] * k, 6),
        "rloo_scale": round(rloo["scale"], 4),
        "rloo_max_z": round(float(z.max()), 2),
        "mean_baseline_scale": round(shrunk["scale"], 4),
        "expected_mean_baseline_scale": round((k - 1) / k, 4),
    }
  out["variance_ratio_k4_over_k2"] = round(out["k"][4]["variance"] / out["k"][2]["variance"], 4) \
      if 2 in out["k"] and 4 in out["k"] else None
  out["seconds"] = round(time.time() - start, 1)
  print(json.dumps(out))


if __name__ == "__main__":
  main()

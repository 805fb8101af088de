"""Not a language model: an MLP regressing `y` from 8 numeric features `x`.

The config (`examples/tabular_mlp.yaml`) names these functions by import
path; the Python API takes them directly:

    python -m examples.tabular_mlp make-data --out ./data/tabular
    python -m ray_resume.run examples/tabular_mlp.yaml
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.nn.functional as F
from torch import nn


def build(model_section: dict) -> nn.Module:
    """Called with the config's `model` section; our settings live in `model.args`."""
    args = model_section["args"]
    return nn.Sequential(
        nn.Linear(args["features"], args["hidden"]),
        nn.ReLU(),
        nn.Dropout(args.get("dropout", 0.0)),
        nn.Linear(args["hidden"], 1),
    )


def loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """Mean squared error of the prediction for `y` (batch holds the `data.columns` as tensors)."""
    return F.mse_loss(model(batch["x"]).squeeze(-1), batch["y"])


def make_data(
    out: str, samples: int = 2048, features: int = 8, files: int = 2, row_groups: int = 4, seed: int = 0
) -> None:
    """Parquet files with `sample_id`, `x` (list<float32>) and `y` = a fixed noisy linear function of x."""
    rng = np.random.default_rng(seed)
    weights = rng.normal(size=features).astype(np.float32)
    x = rng.normal(size=(samples, features)).astype(np.float32)
    y = (x @ weights + 0.1 * rng.normal(size=samples)).astype(np.float32)
    os.makedirs(out, exist_ok=True)
    for f, ids in enumerate(np.array_split(np.arange(samples), files)):
        table = pa.table(
            {
                "sample_id": pa.array(ids, pa.int64()),
                "x": pa.array(list(x[ids]), pa.list_(pa.float32())),
                "y": pa.array(y[ids], pa.float32()),
            }
        )
        tmp = os.path.join(out, f".part-{f:05d}.parquet.tmp")
        pq.write_table(table, tmp, row_group_size=max(1, len(ids) // row_groups))
        os.replace(tmp, os.path.join(out, f"part-{f:05d}.parquet"))
    print(f"wrote {samples} samples with {features} features to {out}")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m examples.tabular_mlp")
    sub = parser.add_subparsers(dest="cmd", required=True)
    make = sub.add_parser("make-data", help="write the example's parquet dataset")
    make.add_argument("--out", default="./data/tabular")
    make.add_argument("--samples", type=int, default=2048)
    args = parser.parse_args()
    make_data(args.out, args.samples)


if __name__ == "__main__":
    main()

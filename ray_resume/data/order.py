"""The sample order, a pure function of (the dataset's row groups, seed, epoch, shuffle, lanes),
and the fingerprint of what it depends on (see the package's docstring)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np

from ..errors import DataError
from .files import ReadUnit, dataset_size

def epoch_unit_order(n_units: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """Order in which unit indices are visited in ``epoch``."""
    if not shuffle:
        return np.arange(n_units, dtype=np.int64)
    return np.random.default_rng([seed, epoch]).permutation(n_units).astype(np.int64)


def unit_row_order(num_rows: int, seed: int, epoch: int, unit_index: int, shuffle: bool) -> np.ndarray:
    """Order in which the rows of unit ``unit_index`` are visited in ``epoch``."""
    if not shuffle:
        return np.arange(num_rows, dtype=np.int64)
    return np.random.default_rng([seed, epoch, unit_index]).permutation(num_rows).astype(np.int64)


def epoch_order(units: Sequence[ReadUnit], seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The full order of ``epoch`` as an ``int64[N, 2]`` array of (unit_index, row)."""
    parts = []
    for ui in epoch_unit_order(len(units), seed, epoch, shuffle):
        rows = unit_row_order(units[ui].num_rows, seed, epoch, int(ui), shuffle)
        parts.append(np.stack([np.full_like(rows, ui), rows], axis=1))
    return np.concatenate(parts, axis=0)


def lane_length(num_samples: int, lanes: int) -> int:
    """Samples per lane per epoch: the epoch's order cut in `lanes` equal parts (the last
    ``num_samples % lanes`` samples of each epoch's order are not used in that epoch)."""
    return num_samples // lanes


def plan_lane(units: Sequence[ReadUnit], seed: int, epoch: int, shuffle: bool, lanes: int, lane: int,
              start_in_lane: int = 0) -> List[Tuple[int, int, int]]:
    """What `lane` of `lanes` reads in ``epoch`` from its position ``start_in_lane`` on.

    A lane is the contiguous part ``[lane*L, (lane+1)*L)`` of the epoch's order (``L`` =
    `lane_length`). Returns ``[(unit_index, row_start, row_end), ...]`` in that order, the rows
    being positions in the unit's permuted row order: no unit lying wholly outside the lane's
    part, or before the offset, is planned.
    """
    length = lane_length(dataset_size(units), lanes)
    if not 0 <= start_in_lane < length:
        raise ValueError(f"start_in_lane={start_in_lane} outside [0, {length})")
    lo, hi = lane * length + start_in_lane, (lane + 1) * length
    plan: List[Tuple[int, int, int]] = []
    cum = 0
    for ui in epoch_unit_order(len(units), seed, epoch, shuffle):
        rows = units[int(ui)].num_rows
        if cum + rows > lo and cum < hi:
            plan.append((int(ui), max(lo, cum) - cum, min(hi, cum + rows) - cum))
        cum += rows
        if cum >= hi:
            break
    return plan


def check_lanes(lanes: int, global_batch_size: int, num_samples: int, start_sample: int = 0) -> None:
    """`lanes` fits the batch size, the dataset and the cursor (a multiple of it: every batch size was)."""
    if lanes < 1 or global_batch_size % lanes:
        raise DataError(f"global_batch_size {global_batch_size} is not a multiple of the {lanes} data lanes "
                        "(data.lanes): every global batch takes the same number of samples from each lane")
    if num_samples < lanes:
        raise DataError(f"the dataset holds {num_samples} samples, fewer than its {lanes} data lanes (data.lanes)")
    if start_sample % lanes:
        raise DataError(f"the data cursor {start_sample} is not a multiple of the {lanes} data lanes (data.lanes): "
                        "it was saved with other lanes")


def data_fingerprint(units: Sequence[ReadUnit], seed: int, shuffle: bool, columns: Dict[str, str], lanes: int = 1,
                     pack: int = 0) -> Dict[str, Any]:
    """What the sample order and the batches depend on, for common.json: a resume that differs
    in any of it would continue with another order (see `fingerprint_changes`).

    The dataset is named by its row groups (file names, not paths, and row
    counts): a copy of it moved elsewhere is the same dataset.
    """
    groups = [[Path(u.file).name, u.row_group, u.num_rows] for u in units]
    return {"seed": int(seed), "shuffle": bool(shuffle), "columns": dict(sorted(columns.items())), "lanes": int(lanes), "pack": int(pack),
            "samples": dataset_size(units), "row_groups": len(units),
            "row_groups_sha256": hashlib.sha256(json.dumps(groups).encode()).hexdigest()}


def fingerprint_changes(saved: Dict[str, Any], now: Dict[str, Any]) -> List[str]:
    """What differs between two `data_fingerprint`s, in config terms (e.g. "data.seed 7 -> 8")."""
    saved = {"lanes": 1, "pack": 0, **saved}  # written before there were lanes or packing
    changes = [f"data.{key} {json.dumps(saved.get(key))} -> {json.dumps(now[key])}"
               for key in ("seed", "shuffle", "columns", "lanes", "pack") if saved.get(key) != now[key]]
    if any(saved.get(key) != now[key] for key in ("samples", "row_groups", "row_groups_sha256")):
        changes.append(f"the dataset at data.path: {saved.get('samples')} samples in {saved.get('row_groups')} row groups -> "
                       f"{now['samples']} in {now['row_groups']}" + (" (other files or row groups)" if saved.get("samples") == now["samples"] else ""))
    return changes

"""Deterministic, exactly resumable sample streams read through Ray Data.

Dataset layout
--------------
A dataset is a directory of ``*.parquet`` files with two columns,
``sample_id: int64`` and ``input_ids: list<int32>`` (every row of the same
length ``seq_len + 1``).  ``python -m ray_resume.data synth ...`` writes a small
learnable synthetic one.

Read units and the sample order
-------------------------------
The unit of reading is one parquet *row group*.  :func:`scan_units` lists the
row groups of the ``*.parquet`` files sorted by file name, reading only the
parquet footers; the position of a unit in that list is its ``unit_index``.

The order in which samples are consumed is a **pure function of
(dataset units, seed, epoch, shuffle, lanes)**:

* per epoch ``e`` the units are visited in the order
  ``np.random.default_rng([seed, e]).permutation(n_units)``;
* inside unit ``i`` the rows are visited in the order
  ``np.random.default_rng([seed, e, i]).permutation(num_rows_i)``;
* ``shuffle=False`` makes both orders the identity.

Lanes (``data.lanes`` = C, see docs/data.md) cut each epoch's order in C
contiguous parts of ``L = N // C`` samples (:func:`plan_lane`); the last
``N % C`` samples of an epoch's order are not served in that epoch. Each
lane is an endless sequence, epoch after epoch. A global batch of ``G``
samples (a multiple of C) takes the next ``G / C`` samples of every lane,
lane 0 first, and rank ``r`` of ``W`` keeps the contiguous slots
``[r*G/W, (r+1)*G/W)`` of it. ``lanes=1`` is a plain walk through the
epochs' orders, where every rank needs every row group.

Why: nothing about the order depends on wall-clock, worker count, task
scheduling or on how far a previous run got.  A checkpoint therefore only has
to store the number of samples consumed ``P``: every lane has served
``P / C`` samples, so a stream restarted with ``start_sample=P`` yields
exactly what an uninterrupted stream yields after ``P`` samples, and with
the global batch size unchanged every step sees the same samples whatever
the world size.

Reading through Ray Data
------------------------
A rank reads only the lanes its slots come from: with ``W`` dividing C, no
row group is read by two ranks (but one cut by a lane's end, by both
lanes).  Per epoch, :class:`SampleStream` plans the reads of its lanes
(:func:`plan_lane`: from the start offset, the first row group sliced at
the right row; none lying wholly before it), orders them by where they
start in their lane, and executes them as
``ray.data.from_items(plan).map_batches(read_fn, batch_size=1)``, where
``read_fn`` reads one row group with pyarrow and applies the within-unit
permutation and the slice.  ``preserve_order`` is on, and the stream
checks that every row arrives in plan order (each carries its read's
index).  While reading costs the rank under ``read_tasks_above`` of its
time (``data.read_tasks_above``), and until the read tasks' processes have
started, the rank runs the same read function on the same plan itself;
outside Ray it always does.  The read tasks request a fraction of a CPU so
they can be scheduled while training workers hold whole CPUs.
"""

from ..errors import DataError
from .files import DEFAULT_COLUMNS, DEFAULT_LANES, INPUT_IDS, SAMPLE_ID, ReadUnit, Tokens, dataset_size, scan_units
from .order import check_lanes, data_fingerprint, epoch_order, epoch_unit_order, fingerprint_changes, lane_length, plan_lane, unit_row_order
from .stream import SampleStream, check_data_map, check_eval_set, data_error_in, quiet_ray_data, read_eval_set
from .synthetic import ensure_dataset, write_synthetic

__all__ = [
    "DataError", "ReadUnit", "Tokens", "SampleStream", "write_synthetic", "ensure_dataset", "scan_units", "dataset_size",
    "epoch_unit_order", "unit_row_order", "epoch_order", "lane_length", "plan_lane", "check_lanes",
    "data_fingerprint", "fingerprint_changes", "check_data_map", "check_eval_set", "read_eval_set", "data_error_in",
    "quiet_ray_data", "SAMPLE_ID", "INPUT_IDS", "DEFAULT_COLUMNS", "DEFAULT_LANES",
]


"""Step-level resumable PyTorch training on Ray Train.

    import ray_resume
    result = ray_resume.fit(train_func, checkpoint={...}, scaling_config=ray.train.ScalingConfig(num_workers=2))
    ck = ray_resume.get_checkpointer()                   # inside train_func, on every rank

    result = ray_resume.train("configs/quickstart.yaml")  # the built-in job, as `python -m ray_resume.run` runs it
    result.checkpoint, result.committed_iteration, result.metrics

The names below come from `ray_resume.api` (the errors from `ray_resume.errors`,
the built-in model from `ray_resume.model`, `DCPReader` from `ray_resume.checkpoint.interop.dcp`),
imported when first used: `import ray_resume` alone loads neither torch nor Ray. What
the docs tell a user to import is here; the modules below are free to move.
"""

from __future__ import annotations

import importlib
import os

__version__ = "0.1.0"

# Ray's driver folds lines of one shape (numbers aside) from several processes within 5 s into one
# "[repeated Nx across cluster]": a restarted group's first progress lines, said by a new rank 0
# within seconds of the lost one's, were missing from the console. Lines of a job's own (`[name] ...`,
# a name being [A-Za-z0-9._-]) are let through by Ray's documented setting, which Ray reads once, as
# it is imported: here, before it is (`python -m ray_resume.run`, or `import ray_resume` first).
OWN_LINES = r"^\[[A-Za-z0-9._-]+\] "
if OWN_LINES not in os.environ.get("RAY_DEDUP_LOGS_ALLOW_REGEX", ""):
    os.environ["RAY_DEDUP_LOGS_ALLOW_REGEX"] = "|".join(
        filter(None, (os.environ.get("RAY_DEDUP_LOGS_ALLOW_REGEX"), OWN_LINES))
    )

_WHERE = {
    "fit": "api",
    "train": "api",
    "get_checkpointer": "api",
    "Result": "api",
    "Start": "api",
    "TrainingFailed": "api",
    "CheckpointConfig": "api",
    "ConfigError": "errors",
    "CheckpointError": "errors",
    "DataError": "errors",
    "SampleStream": "data",  # the built-in job's deterministic, resumable data cursor
    "GPT": "model",  # the built-in model
    "lm_loss": "model",
    "DCPReader": "checkpoint.interop.dcp:Reader",  # a root read in place by torch.distributed.checkpoint.load
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        module, _, attribute = _WHERE[name].partition(":")
        return getattr(importlib.import_module(f".{module}", __name__), attribute or name)
    raise AttributeError(f"module 'ray_resume' has no attribute {name!r}")


def __dir__() -> list[str]:
    return [*globals(), *__all__]

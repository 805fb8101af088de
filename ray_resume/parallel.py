"""Data parallelism: wrap the model for DDP or shard it with FSDP2, and control gradient sync.

Under `strategy: fsdp` every parameter becomes a DTensor sharded on dim 0
over all ranks (torch FSDP2 `fully_shard`, one 1-D mesh), so does the
optimizer state that AdamW creates for it; the checkpoint saves those
shards as they are (layout `dim0`). Units are sharded bottom-up, then the
root, as torchtitan does.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel

from .errors import ConfigError


def fsdp_units(model: nn.Module, class_names: list[str]) -> list[nn.Module]:
    """The submodules to shard as units: instances of `class_names`, or by default each module of an nn.ModuleList."""
    if class_names:
        found = {type(m).__name__ for m in model.modules()}
        missing = sorted(set(class_names) - found)
        if missing:
            raise ConfigError(
                f"model.fsdp_units: the model has no module of class {missing[0]!r} "
                f"(its classes: {', '.join(sorted(found))})"
            )
        return [m for m in model.modules() if type(m).__name__ in class_names and m is not model]
    return [m for lst in model.modules() if isinstance(lst, nn.ModuleList) for m in lst]


def wrap(model: nn.Module, strategy: str, units: list[str], device: torch.device, world_size: int) -> nn.Module:
    if strategy == "fsdp":
        mesh = init_device_mesh(device.type, (world_size,))
        for unit in fsdp_units(model, units):
            fully_shard(unit, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    return DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)


@contextmanager
def gradient_sync(model: nn.Module, enabled: bool):
    """Accumulate gradients locally (enabled=False) or reduce them across ranks on this backward."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
        yield
    elif enabled:
        yield
    else:
        with model.no_sync():
            yield

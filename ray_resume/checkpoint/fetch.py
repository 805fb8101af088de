"""Where a rank's checkpoint bytes come from: storage directly, or load_balanced.

Under DDP every rank needs every tensor, so a direct load reads the whole
checkpoint W times. With `load_balanced: true` (spec 2.2, scenario D) the
shard files are dealt out to ranks by size (largest first, to the least
loaded rank), each rank reads and verifies only its own, and every file is
then broadcast from its reader over the process group: each byte comes off
storage once in total. Both modes count the bytes they read.
"""

from __future__ import annotations

import heapq
import logging

import torch
import torch.distributed as dist

from .reader import Iteration, read_verified
from .schema import CheckpointError

logger = logging.getLogger(__name__)


def collective_device() -> torch.device:
    """Where tensors for the process group's collectives must live (the GPU under NCCL)."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def deal_by_size(sizes: list[int], world_size: int) -> list[int]:
    """Owner rank of each item: largest first to the least-loaded rank (ties to the lowest rank)."""
    owners = [0] * len(sizes)
    loads = [(0, rank) for rank in range(world_size)]
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, rank = heapq.heappop(loads)
        owners[index] = rank
        heapq.heappush(loads, (load + sizes[index], rank))
    return owners


class ShardFetcher:
    """Verified bytes of shard files, cached for the one load, with a storage byte counter."""

    def __init__(self, storage, it: Iteration, rank: int, world_size: int, balanced: bool):
        self.storage, self.it = storage, it
        self.rank, self.world_size = rank, world_size
        self.balanced = balanced and world_size > 1
        self.cache: dict[str, bytes] = {}
        self.device = collective_device()
        self.bytes_read = 0

    def __call__(self, names: list[str]) -> dict[str, bytes]:
        missing = sorted(n for n in set(names) if n not in self.cache)
        if missing:
            self.cache.update(self._balanced(missing) if self.balanced else self._read(missing))
        return {n: self.cache[n] for n in names}

    def _read(self, names: list[str]) -> dict[str, bytes]:
        data = read_verified(self.storage, self.it, names)
        self.bytes_read += sum(len(b) for b in data.values())
        return data

    def _balanced(self, names: list[str]) -> dict[str, bytes]:
        # Every rank calls this with the same names (they come from metadata.json),
        # so all ranks agree on the owners and on the order of the broadcasts.
        sizes = [self.it.metadata["files"][n]["size"] for n in names]
        owners = deal_by_size(sizes, self.world_size)
        mine, error = {}, None
        try:
            mine = self._read([n for n, o in zip(names, owners) if o == self.rank])
        except CheckpointError as exc:
            error = exc
        # Agree before broadcasting: a rank that found damage must not leave the others waiting.
        failed = torch.tensor([1 if error else 0], device=self.device)
        dist.all_reduce(failed)
        if error:
            raise error
        if failed.item():
            raise CheckpointError(f"{self.it.path}: another rank found a damaged shard while loading (load_balanced); see its error")
        out = {}
        for name, size, owner in zip(names, sizes, owners):
            if owner == self.rank:
                buffer = torch.frombuffer(bytearray(mine[name]), dtype=torch.uint8).to(self.device)
            else:
                buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
            dist.broadcast(buffer, src=owner)  # NCCL needs the bytes on the GPU, gloo takes them on the host
            out[name] = mine[name] if owner == self.rank else buffer.cpu().numpy().tobytes()
        return out

"""How a rank loads its part of an iteration: which files it reads, whole or by range, and load_balanced.

A rank asks for element ranges of tensors (all of each tensor under DDP,
its own dim-0 chunk under FSDP) and gets them in fresh tensors; every byte
read from storage is counted.

- Direct: the file of saving rank s is read whole, with the digest of each
  checksum block checked, by loading rank s mod W' (its verifier); any other
  rank that needs part of it reads just those byte ranges. Every file is
  verified by exactly one rank, and the ranks agree that all checks passed
  before anyone returns.
  FSDP on the same world size reads each file once; DDP reads the whole
  checkpoint W' times. Small replicated leftovers of an FSDP state (Adam's
  0-d steps) come only from the verifiers' reads and reach every rank in
  one all-reduce.
- `load_balanced: true` (spec 2.2, scenario D; replicated targets only): the
  checksum blocks of every file of every kind the restore loads are
  divided between the ranks (`divide_blocks`: one consecutive run per
  rank, the largest as small as possible, or at ~100k ranks single blocks
  dealt largest first); each rank reads and checks its blocks, then every
  part of a piece is broadcast from the rank that read its block straight
  into the other ranks' tensors. Each byte comes off storage once in
  total, and no rank reads more than one block (4 MiB) above the mean.

Then what is loaded is put in place: `assign` (into the model's tensors, this
rank's shard of each), `load_weights` (an export's whole tensors), and
`from_mindformers` (a MindFormers optimizer's state as torch's keeps it).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import logging

import torch
import torch.distributed as dist

from ..collectives import collective_device, decided_by_rank0, largest
from .format import names, paths, state
from .format.checks import check_weights
from .format.plan import TensorSpec, needed_range
from .interop.export import EXPORT_INDEX, export_files
from .io.reader import ShardReader, parse_shard, plan_reads
from .io.iterations import check_no_extra_shards, open_iteration
from .format.parse import parse_iteration
from .root import CheckpointRoot
from .format.schema import Iteration
from .io.storage import Storage
from ..errors import CheckpointError, DamagedShards
from .format.state import DTYPE_TAGS, DTYPES

logger = logging.getLogger(__name__)


def open_shared(root: CheckpointRoot, step: int, rank: int, world_size: int) -> Iteration:
    """The iteration's JSON files and shard listing, read and checked by rank 0 alone, then broadcast.

    Every rank needs metadata.json, but at 12,288 ranks on S3 each fetching
    its 6.6 MB would be 81 GB of GETs (and 12,288 listings) per load.
    """
    parsed = []  # rank 0's own parse, kept: the iteration is parsed once in each process

    def read() -> dict:
        parsed.append(open_iteration(root.storage, root.uri, step))
        check_no_extra_shards(root.storage, parsed[0])
        return parsed[0].raw

    raw = decided_by_rank0(read, rank, f"read iteration {step} under {root.uri}")
    return parsed[0] if parsed else parse_iteration(raw, root.uri, step)


def balanced_owners(it: Iteration, kinds, world_size: int) -> dict[tuple[str, int], int]:
    """load_balanced: (shard file, checksum block) -> the rank that reads it (`divide_blocks`).

    The checksum blocks of all files of all `kinds`, in order (kind, saving
    rank, block), are divided in one go, not kind by kind: per kind, the
    same ranks would draw the extra block of each kind.
    """
    blocks = [
        (f, i, hi - lo)
        for kind in kinds
        for f in it.shard_files(kind)
        for i, (lo, hi, _) in enumerate(it.files[f].blocks(it.block_size))
    ]
    owners = divide_blocks([size for _, _, size in blocks], world_size)
    return {(f, i): owner for (f, i, _), owner in zip(blocks, owners)}


# A rank whose share is at least this many blocks reads one consecutive run of them.
RUN_BLOCKS = 10


def divide_blocks(sizes: list[int], world_size: int) -> list[int]:
    """The rank that reads each checksum block (sizes in file order).

    A share of at least RUN_BLOCKS blocks: one consecutive run per rank
    (`even_runs`), a stretch of one or a few files read with one request
    each; the half block of slack a run leaves is then at most 5% of it.
    A smaller share (~100k ranks): blocks dealt one by one, largest first
    (`deal_by_size`); a rank then reads fewer than RUN_BLOCKS blocks
    however scattered, and a run's slack would be a large part of its share
    (1.28x the mean at 98,304 ranks, against 1.05).
    """
    if sum(sizes) >= RUN_BLOCKS * world_size * max(sizes, default=0):
        return even_runs(sizes, world_size)
    return deal_by_size(sizes, world_size)


def deal_by_size(sizes: list[int], world_size: int) -> list[int]:
    """Owner rank of each item: largest first to the least-loaded rank (ties to the lowest rank)."""
    owners = [0] * len(sizes)
    loads = [(0, rank) for rank in range(world_size)]
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, rank = heapq.heappop(loads)
        owners[index] = rank
        heapq.heappush(loads, (load + sizes[index], rank))
    return owners


def even_runs(sizes: list[int], world_size: int) -> list[int]:
    """The rank of each item when the items are cut, in order, into at most `world_size` consecutive
    runs whose largest total is as small as any such cut allows.

    A binary search on that largest total C, each probe a greedy pass that
    ends a run where the next item would pass C (bisection on the prefix
    sums): O(W log n) per probe. Cutting at the even byte marks k·T/W
    instead can put nearly a whole extra block on a rank.
    """
    prefix = list(itertools.accumulate(sizes, initial=0))
    total, n, largest = prefix[-1], len(sizes), max(sizes, default=0)

    def run_ends(cap: int) -> list[int] | None:
        ends, i = [], 0
        while i < n:
            j = bisect.bisect_right(prefix, prefix[i] + cap) - 1
            if j == i or len(ends) == world_size:
                return None
            ends.append(j)
            i = j
        return ends

    lo, hi = max(-(-total // world_size), largest), -(-total // world_size) + largest  # hi always fits
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if run_ends(mid) is not None else (mid + 1, hi)
    owners: list[int] = []
    for rank, end in enumerate(run_ends(lo)):
        owners += [rank] * (end - len(owners))
    return owners


def owned_parts(spans, blocks, owner_of):
    """(request, span's first byte, part's first byte, part's end byte, owner) for each longest part
    of a requested span whose checksum blocks one rank reads: one broadcast each (a broadcast per
    block costs ~25% of a 2-rank load over gloo).

    `spans` are `ShardReader.spans`, `blocks` `ShardReader.blocks`, both sorted by position;
    `owner_of(i)` is the rank that reads block i.
    """
    i = 0
    for first, last, r in spans:
        if last <= first:
            continue
        while blocks[i][1] <= first:
            i += 1
        j, lo = i, first
        while j < len(blocks) and blocks[j][0] < last:
            if j + 1 == len(blocks) or blocks[j + 1][0] >= last or owner_of(j + 1) != owner_of(j):
                end = min(last, blocks[j][1])
                yield r, first, lo, end, owner_of(j)
                lo = end
            j += 1


class StateLoader:
    """Loads tensors of one iteration for `rank` of a `world_size` group (see the module doc).

    `kinds` are the kinds this restore will load (all the iteration holds by
    default): load_balanced divides their checksum blocks in one go.
    """

    def __init__(self, storage, it: Iteration, rank: int = 0, world_size: int = 1, balanced: bool = False, kinds=None):
        self.it = it
        self.rank, self.world_size = rank, world_size
        # Dealing checksum blocks needs them: a MindFormers checkpoint has none, and is read directly.
        self.balanced = balanced and world_size > 1 and all(f.digests is not None for f in it.files.values())
        self.kinds = tuple(kinds or it.tensors)
        self.reader = ShardReader(storage, it)
        self.device = collective_device()
        self._dealt: dict[tuple[str, int], int] | None = None

    def dealt(self) -> dict[tuple[str, int], int]:
        """load_balanced: who reads each checksum block (`balanced_owners` over `kinds`), computed once."""
        if self._dealt is None:
            self._dealt = balanced_owners(self.it, self.kinds, self.world_size)
        return self._dealt

    @property
    def bytes_read(self) -> int:
        return self.reader.bytes_read

    def load(
        self,
        kind: str,
        ranges: dict[str, tuple[int, int]],
        *,
        shared: set[str],
        into: dict[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Flat tensors holding elements [start, start + numel) of each named tensor.

        `into` holds flat CPU tensors of the right dtype and size to fill in
        place (the live model's, say): bytes are read straight into them, and
        only the other ranges get fresh tensors (first-touching fresh pages
        costs ~0.2 s/GB here, as much as reading the bytes from page cache).
        A damaged shard leaves them partly overwritten: the restore then falls
        back to an older iteration, which overwrites them again, or fails.

        `shared` names the tensors every rank wants whole (replicated state);
        all ranks pass the same set. When all are shared (DDP), load_balanced
        applies. Otherwise (FSDP) the shared ones are small leftovers such as
        Adam's 0-d steps, spread over many files: only each file's verifier
        copies them out of the stream it reads anyway, and one all-reduce
        hands them to every rank, instead of every rank fetching each one.
        """
        replicated = shared >= set(ranges)
        balanced = self.balanced and replicated
        pooled = set() if replicated or self.world_size == 1 or not dist.is_initialized() else shared & set(ranges)
        packed, pool = self._pool(kind, {n: ranges[n] for n in sorted(pooled)})  # same layout on every rank
        dests, reads = plan_reads(
            self.it, kind, ranges, {**{n: t for n, t in (into or {}).items() if n in ranges}, **pool}
        )
        files = self.it.shard_files(kind)
        dealt = self.dealt() if balanced else {}
        error = None
        try:
            for saver, file in enumerate(files):
                if balanced:
                    mine = [i for i in range(len(self.reader.blocks(file))) if dealt[file, i] == self.rank]
                    if mine:
                        self.reader.read_checked(file, reads.get(file, []), blocks=mine)
                elif saver % self.world_size == self.rank:
                    self.reader.read_checked(file, reads.get(file, []))
                else:
                    mine = [r for r in reads.get(file, []) if r.piece.name not in pooled]
                    if mine:
                        self.reader.read_ranges(file, mine)
        except CheckpointError as exc:
            error = exc
        self._agree(error)
        if balanced:
            for file in files:
                spans = self.reader.spans(file, reads.get(file, []))
                for r, first, lo, hi, owner in owned_parts(spans, self.reader.blocks(file), lambda i: dealt[file, i]):
                    self._broadcast(r.dest.view(torch.uint8)[lo - first : hi - first], owner)
        if pooled:
            # Each pooled byte was copied by exactly one rank (its file's verifier), zeros
            # elsewhere: an integer sum gives every rank the exact bytes.
            summed = packed.view(torch.int64).to(self.device)
            dist.all_reduce(summed)
            packed.view(torch.int64).copy_(summed.cpu())
        return dests

    def _pool(self, kind: str, ranges: dict[str, tuple[int, int]]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One zeroed byte buffer holding a destination for each range (8-byte aligned), and the views."""
        specs = self.it.specs(kind)
        offsets, total = {}, 0
        for name, (_, numel) in ranges.items():
            offsets[name] = total
            total += -(-numel * specs[name].itemsize // 8) * 8
        packed = torch.zeros(total, dtype=torch.uint8)
        views = {}
        for name, (_, numel) in ranges.items():
            dtype = DTYPES[specs[name].dtype]
            views[name] = packed[offsets[name] : offsets[name] + numel * dtype.itemsize].view(dtype)
        return packed, views

    def _agree(self, error: CheckpointError | None) -> None:
        """Every rank learns whether any rank found damage, so none waits for a peer that gave up."""
        damaged = DamagedShards(str(error)) if error else None
        if not (dist.is_initialized() and self.world_size > 1):
            if damaged:
                raise damaged from error
            return
        [failed] = largest([int(error is not None)])
        if damaged:
            raise damaged from error
        if failed:
            raise DamagedShards(f"{self.it.path}: another rank found a damaged shard while loading; see its error")

    def _broadcast(self, dest: torch.Tensor, owner: int) -> None:
        if not dest.numel():
            return
        if self.device.type == "cpu":
            dist.broadcast(dest, src=owner)  # straight into this rank's tensor
            return
        staged = dest.to(self.device)  # NCCL moves GPU memory only
        dist.broadcast(staged, src=owner)
        dest.copy_(staged.cpu())


def load_state(storage, it: Iteration, kind: str) -> dict[str, torch.Tensor]:
    """Every tensor of `kind`, whole and shaped, in this process (tools, tests, exports)."""
    if kind not in it.tensors:
        raise CheckpointError(f"{it.path}/metadata.json: holds no {kind!r} tensors")
    specs = list(it.specs(kind).values())
    ranges = {s.name: (0, s.numel) for s in specs}
    flat = StateLoader(storage, it).load(kind, ranges, shared=set(ranges))
    return {s.name: flat[s.name].reshape(s.shape) for s in specs}


def is_fsdp_shard(spec: TensorSpec, live: torch.Tensor | None) -> bool:
    """The live tensor is an FSDP dim-0 shard of this saved tensor (same global shape)."""
    return live is not None and state.dim0_sharded(live) and tuple(live.shape) == spec.shape


def load_weights(model, weights: dict[str, torch.Tensor], where: str, rank: int = 0, world_size: int = 1) -> None:
    """Load whole tensors `weights` (an export) into `model`, this rank's shards of them under FSDP."""
    live = state.model_tensors(model)
    specs = {n: TensorSpec(n, DTYPE_TAGS[t.dtype], tuple(t.shape), t.element_size()) for n, t in weights.items()}
    check_weights(live, specs, state.tied_aliases(model), where)
    assign(
        live,
        {
            n: _elements(weights[n], needed_range(specs[n], is_fsdp_shard(specs[n], t), world_size, rank))
            for n, t in live.items()
        },
    )


def from_mindformers(tensors: dict[str, torch.Tensor], it, loader: StateLoader, optimizer) -> dict[str, torch.Tensor]:
    """A MindFormers optimizer's state as the torch optimizer keeps it. Its Adam keeps one step count
    for every parameter (`global_step`, else common.json's): each parameter with moments gets it as
    torch's `step`. Without main params (saved by an fp32 model) a low-precision model's are its weights."""
    if names.GLOBAL_STEP in it.tensors[paths.OPTIM_KIND]:
        whole = loader.load(paths.OPTIM_KIND, {names.GLOBAL_STEP: (0, 1)}, shared={names.GLOBAL_STEP})[
            names.GLOBAL_STEP
        ]
        count = float(whole.reshape(-1)[0].item())
    else:
        count = float(it.common["global_step"])
    out = dict(tensors)
    for name in tensors:
        param, slot = names.parse_state_name(name)
        step = names.state_name(param, names.STEP)
        if slot == "exp_avg" and step not in out:
            out[step] = torch.tensor(count, dtype=torch.float32)
    mains = [n for n, _ in optimizer.named_main() if names.state_name(n, names.MAIN_PARAM) not in out]
    if getattr(optimizer, "mixed", False) and mains:
        logger.warning(
            "%s holds no fp32 main params (saved by an fp32 model): they start from the loaded weights", it.path
        )
        with torch.no_grad():
            for name, main in optimizer.named_main():
                out[names.state_name(name, names.MAIN_PARAM)] = (
                    state.local_tensor(dict(optimizer.named)[name]).detach().float()
                )
    return out


def assign(live: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor]) -> None:
    """Copy loaded elements into the model's tensors (this rank's shard of each, under FSDP); tied aliases follow."""
    with torch.no_grad():
        for name, tensor in live.items():
            local = state.local_tensor(tensor)
            if loaded[name].data_ptr() != local.data_ptr():  # not loaded in place
                local.copy_(loaded[name].view(local.shape))


def _elements(t: torch.Tensor, r: tuple[int, int]) -> torch.Tensor:
    start, numel = r
    return t.reshape(-1)[start : start + numel]


def shaped(flat: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """A loaded range in its tensor's shape: the whole tensor, or a dim-0 chunk of rows."""
    return flat.reshape(spec.shape) if flat.numel() == spec.numel else flat.reshape(-1, *spec.shape[1:])


def read_export(storage: Storage, path: str) -> tuple[dict[str, torch.Tensor], int]:
    """Weights from `model.safetensors`, or from the shards a `model.safetensors.index.json` maps; and the bytes read."""
    files, weight_map = export_files(storage, path)
    out: dict[str, torch.Tensor] = {}
    read = 0
    for file in files:
        data = storage.read_bytes(file)
        read += len(data)
        out.update(parse_shard(data, file))
    if weight_map is not None and set(weight_map) != set(out):
        missing = sorted(set(weight_map) - set(out)) or sorted(set(out) - set(weight_map))
        raise CheckpointError(
            f"{paths.join(path, EXPORT_INDEX)}: weight_map and the shard files disagree about tensor {missing[0]!r}"
        )
    return out, read

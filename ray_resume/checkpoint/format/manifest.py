"""What a rank reports once its shards of an iteration are durable: one definition, from the writer
(`writer.write_shards`) through the controller to the commit, which builds metadata.json from every
rank's (`commit.commit_iteration`, `commit.build_metadata`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WrittenFile:
    """One shard file as written: what metadata.json lists of it."""

    size: int  # bytes on storage
    data_start: int  # where its data section starts: the safetensors header's end
    checksum: str  # the digests' algorithm (checkpoint.checksum)
    digests: list[str]  # one per checksum block of the data section


@dataclass(frozen=True, slots=True)
class Manifest:
    """Rank `rank` of `world_size` wrote `files`, holding `chunks` of the tensors."""

    rank: int
    world_size: int
    block_size: int  # the checksum block
    files: dict[str, WrittenFile]  # shard file name -> what was written
    chunks: dict[str, list[tuple[str, int, int]]]  # kind -> (tensor, first row, rows) of each piece this rank holds
    specs: dict[str, list[tuple[str, str, list[int]]]]  # rank 0's only: kind -> (tensor, dtype tag, global shape)
    model: dict | None = None  # rank 0's only: state.export_facts of the model (what an export writes)

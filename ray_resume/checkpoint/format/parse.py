"""`parse_iteration`: the three kinds of iteration ray_resume reads, as one `schema.Iteration`.

Format 5 (ours, MindFormers' schema: `parse_ours`); format 4 (ours before MindFormers'
schema; read, never written); and one MindFormers' `save_checkpoint` wrote, with its metadata.json
or, for a single card, its shards alone, which its own loader reads by their safetensors headers.
Pure: the caller reads the files.
"""

from __future__ import annotations

from typing import Any

from . import names, paths
from ...errors import CheckpointError
from .plan import Piece, TensorSpec, format4_pieces
from .schema import (
    CKPT_NORMAL,
    COMMON_FIELDS,
    Entry,
    Iteration,
    Stored,
    StoredFile,
    check_step,
    chunks_of,
    common_of,
    listed_files,
    place_entries,
    check_fields,
    local_shape,
)


def parse_iteration(raw: dict, root: str, step: int) -> Iteration:
    """The iteration `raw` describes: `common` (common.json), `metadata` (metadata.json, None where
    MindFormers wrote none) and `headers` (file -> {"size", "header"}: MindFormers' shards only)."""
    directory = paths.iteration_dir(root, step)
    meta = raw.get("metadata")
    if meta is not None and "ray_resume" in meta:
        return parse_ours(raw, root, step, directory)
    if meta is not None and "format_version" in meta:
        return _parse_format4(raw, root, step, directory)
    return _parse_mindformers(raw, root, step, directory)


OURS_FIELDS = {
    "format_version": int,
    "iteration": int,
    "world_size": int,
    "block_size": int,
    "prefix": str,
    "files": dict,
}


def parse_ours(raw: dict, root: str, step: int, directory: str) -> Iteration:
    meta_file, common_file = paths.join(directory, paths.METADATA), paths.join(directory, paths.COMMON)
    meta = raw["metadata"]
    ours = meta["ray_resume"]
    if not isinstance(ours, dict):
        raise CheckpointError(f"{meta_file}: 'ray_resume' must be an object")
    check_fields(ours, {"format_version": int}, f"{meta_file}: ray_resume")
    if ours["format_version"] != paths.FORMAT_VERSION:
        raise CheckpointError(
            f"{meta_file}: format_version {ours['format_version']} is not supported by this ray_resume "
            f"(it reads 4 and {paths.FORMAT_VERSION}); use the ray_resume release that wrote it"
        )
    check_fields(ours, OURS_FIELDS, f"{meta_file}: ray_resume")
    for key in ("world_size", "block_size"):
        if ours[key] < 1:
            raise CheckpointError(f"{meta_file}: ray_resume.{key} has the impossible value {ours[key]}")
    if ours["iteration"] != step:
        raise CheckpointError(f"{meta_file}: iteration {ours['iteration']} is not this directory's iteration {step}")
    common = common_of(raw["common"], common_file, exact=True)
    check_step(common, step, common_file)
    files = listed_files(ours["files"], ours, meta_file, prefix=ours["prefix"])
    tensors = chunks_of(
        meta,
        meta_file,
        lambda entries: next(
            (e["file_name"] for e in entries if isinstance(e, dict) and e.get("file_name") in files), None
        ),
    )
    place_entries(files, tensors, directory, flat=False)
    facts = {k: v for k, v in ours.items() if k not in OURS_FIELDS}
    _check_export_facts(facts.get("model"), f"{meta_file}: ray_resume.model")
    return Iteration(
        root, step, directory, common, facts, "ray_resume", ours["world_size"], ours["block_size"], files, tensors, raw
    )


def _check_export_facts(facts: Any, where: str) -> None:
    """`ray_resume.model` (state.export_facts), where present: what an export writes from it."""
    if facts is None:
        return
    tied, hf = (facts.get("tied"), facts.get("transformers")) if isinstance(facts, dict) else (None, None)
    if not isinstance(tied, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in tied.items()):
        raise CheckpointError(f"{where}.tied must map tensor names to tensor names")
    if hf is not None and not (
        isinstance(hf, dict)
        and isinstance(hf.get("prefix"), str)
        and isinstance(hf.get("config"), dict)
        and isinstance(hf["config"].get("architectures"), list)
    ):
        raise CheckpointError(f"{where}.transformers must hold 'prefix' and a 'config' with an 'architectures' list")


FORMAT4_FIELDS = {
    "format_version": int,
    "iteration": int,
    "world_size": int,
    "block_size": int,
    "files": dict,
    "tensors": dict,
}
FORMAT4_COMMON = {
    "global_step": int,
    "global_batch_size": int,
    "step_num": int,
    "epoch_num": int,
    "loss_scale": (int, float),
    "ckpt_status": str,
    "consumed_samples": int,
    "world_size": int,
    "has_optimizer": bool,
    "job_id": str,
}
FORMAT4_LAYOUTS = ("split", "dim0")


def _parse_format4(raw: dict, root: str, step: int, directory: str) -> Iteration:
    """Format 4 (ray_resume before MindFormers' schema): pieces fixed by each tensor's layout."""
    meta_file, common_file = paths.join(directory, paths.METADATA), paths.join(directory, paths.COMMON)
    meta, old = raw["metadata"], raw["common"]
    check_fields(meta, {"format_version": int}, meta_file)
    if meta["format_version"] != 4:
        raise CheckpointError(
            f"{meta_file}: format_version {meta['format_version']} is not supported by this ray_resume "
            f"(it reads 4 and {paths.FORMAT_VERSION}); use the ray_resume release that wrote it"
        )
    check_fields(meta, FORMAT4_FIELDS, meta_file)
    check_fields(old, {**FORMAT4_COMMON, "format_version": int}, common_file)
    if old["ckpt_status"] != "ok":
        raise CheckpointError(
            f"{common_file}: ckpt_status is {old['ckpt_status']!r}, not 'ok'; this iteration is not complete"
        )
    if meta["iteration"] != step:
        raise CheckpointError(f"{meta_file}: iteration {meta['iteration']} is not this directory's iteration {step}")
    if old["world_size"] != meta["world_size"]:
        raise CheckpointError(
            f"{common_file}: world_size {old['world_size']}, but metadata.json lists the shards of {meta['world_size']} ranks"
        )
    common = common_of(
        {**{k: old[k] for k in COMMON_FIELDS if k != "ckpt_status"}, "ckpt_status": CKPT_NORMAL},
        common_file,
        exact=False,
    )
    check_step(common, step, common_file)
    ours = {"world_size": meta["world_size"], "block_size": meta["block_size"]}
    files = listed_files(meta["files"], ours, meta_file, prefix=meta.get("prefix", "ckpt"))
    tensors: dict[str, dict[str, Stored]] = {}
    for kind, by_name in meta["tensors"].items():
        if kind not in (paths.MODEL_KIND, paths.OPTIM_KIND) or not isinstance(by_name, dict):
            raise CheckpointError(f"{meta_file}: tensors[{kind!r}] is not a known kind (model, opt)")
        specs, layouts = [], {}
        for name, t in by_name.items():
            label = f"{meta_file}: tensors.{kind}[{name!r}]"
            if (
                not isinstance(t, dict)
                or t.get("dtype") not in names.DTYPES
                or not isinstance(t.get("shape"), list)
                or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in t["shape"])
            ):
                raise CheckpointError(f"{label} needs a known 'dtype' and a 'shape' list of non-negative integers")
            if t.get("layout") not in FORMAT4_LAYOUTS or (t["layout"] == "dim0" and not t["shape"]):
                raise CheckpointError(
                    f"{label}: 'layout' must be one of {list(FORMAT4_LAYOUTS)} (dim0 needs a shape), got {t.get('layout')!r}"
                )
            specs.append(TensorSpec(name, t["dtype"], tuple(t["shape"]), names.itemsize(t["dtype"])))
            layouts[name] = t["layout"]
        world = meta["world_size"]
        shard = {r: paths.shard_filename(meta.get("prefix", "ckpt"), kind, r, world) for r in range(world)}
        missing = sorted(set(shard.values()) - set(files))
        if missing:
            raise CheckpointError(
                f"{meta_file}: shard {missing[0]!r} is not listed in 'files'; the iteration is incomplete"
            )
        placed = format4_pieces(specs, layouts, world)
        tensors[kind] = {}
        for s in specs:  # optimizer state under today's names (`{param}.{slot}` then): the pieces keep the files' keys
            name = names.state_name(*s.name.rsplit(".", 1)) if kind == paths.OPTIM_KIND else s.name
            pieces = tuple((shard[r], p) for r, p in sorted(placed.get(s.name, []), key=lambda rp: rp[1].start))
            tensors[kind][name] = Stored(TensorSpec(name, s.dtype, s.shape, s.itemsize), pieces)
    if old["has_optimizer"] != (paths.OPTIM_KIND in tensors):
        raise CheckpointError(
            f"{common_file}: has_optimizer is {str(old['has_optimizer']).lower()}, but metadata.json "
            f"{'lists' if paths.OPTIM_KIND in tensors else 'lists no'} optimizer state"
        )
    for name in files:
        if files[name].kind not in tensors:
            raise CheckpointError(
                f"{meta_file}: files[{name!r}] is not a shard of this {meta['world_size']}-rank iteration"
            )
    place_entries(files, tensors, directory, flat=True)
    facts = {
        k: v
        for k, v in old.items()
        if k not in COMMON_FIELDS and k not in ("format_version", "ckpt_status", "has_optimizer")
    }
    return Iteration(
        root, step, directory, common, facts, "ray_resume", meta["world_size"], meta["block_size"], files, tensors, raw
    )


def _parse_mindformers(raw: dict, root: str, step: int, directory: str) -> Iteration:
    """A root MindFormers' save_checkpoint wrote: its shards (`raw["headers"]`, read by their safetensors
    headers), placed by its metadata.json, or, with none (one card), each file holding whole tensors."""
    common_file, meta_file = paths.join(directory, paths.COMMON), paths.join(directory, paths.METADATA)
    common = dict(raw["common"])
    if (
        common.get("consumed_samples") is None
        and isinstance(common.get("global_step"), int)
        and isinstance(common.get("global_batch_size"), int)
    ):
        # not kept by every MindFormers trainer
        common["consumed_samples"] = common["global_step"] * common["global_batch_size"]
    common = common_of(common, common_file, exact=False)
    check_step(common, step, common_file)
    headers = raw.get("headers") or {}
    if not headers:
        raise CheckpointError(
            f"{directory}: holds no shard file ({{prefix-}}model|opt-RANK-WORLD.safetensors); "
            "not a MindFormers checkpoint either"
        )
    files: dict[str, StoredFile] = {}
    worlds = set()
    for name, h in sorted(headers.items()):
        shard = paths.parse_shard_filename(name)
        if shard is None or not paths.is_plain_filename(name):
            raise CheckpointError(f"{paths.join(directory, name)}: not a MindFormers shard file name")
        worlds.add(shard["world"])
        files[name] = _header_file(name, shard, h, paths.join(directory, name))
    if len(worlds) != 1:
        raise CheckpointError(f"{directory}: shard files of world sizes {sorted(worlds)}; a checkpoint is saved by one")
    (world,) = worlds
    meta = raw.get("metadata")
    if meta is not None:
        tensors = chunks_of(
            meta,
            meta_file,
            lambda entries: next(
                (
                    e["file_name"]
                    for e in sorted((e for e in entries if isinstance(e, dict)), key=lambda e: e.get("storage_rank", 0))
                    if e.get("file_name") in files
                ),
                None,
            ),
        )
        for kind, by_name in tensors.items():
            for name, stored in by_name.items():
                for file, piece in stored.pieces:
                    _check_header_entry(files[file], stored.spec, piece, paths.join(directory, file))
    else:  # one card: every tensor whole in one file, as MindFormers' own loader then reads them
        tensors = {}
        for name, f in files.items():
            for tensor, e in f.entries.items():
                if any(tensor in by_name for by_name in tensors.values()):
                    raise CheckpointError(
                        f"{paths.join(directory, name)}: tensor {tensor!r} is in another shard file too; "
                        "without metadata.json each must be in one"
                    )
                spec = TensorSpec(tensor, e.dtype, e.shape, names.itemsize(e.dtype))
                tensors.setdefault(f.kind, {})[tensor] = Stored(spec, ((name, Piece(tensor, 0, spec.numel)),))
    return Iteration(root, step, directory, common, {}, "mindformers", world, 0, files, tensors, raw)


def _header_file(name: str, shard: dict, h: dict, where: str) -> StoredFile:
    """A shard file as its safetensors header describes it (no digests: MindFormers keeps none)."""
    size, header = h.get("size"), h.get("header")
    if not isinstance(size, int) or not isinstance(header, dict):
        raise CheckpointError(f"{where}: not a valid safetensors file")
    data_start = h.get("data_start")
    f = StoredFile(name, shard["kind"], shard["rank"], size, data_start, None, None)
    for tensor, t in header.items():
        if tensor == "__metadata__":
            continue
        ok = (
            isinstance(t, dict)
            and t.get("dtype") in names.DTYPES
            and isinstance(t.get("shape"), list)
            and isinstance(t.get("data_offsets"), list)
            and len(t["data_offsets"]) == 2
        )
        if ok:
            begin, end = t["data_offsets"]
            shape = tuple(t["shape"])
            numel = 1
            for d in shape:
                numel *= d
            ok = 0 <= begin <= end <= size - data_start and end - begin == numel * names.itemsize(t["dtype"])
        if not ok:
            raise CheckpointError(
                f"{where}[{tensor!r}]: the safetensors header does not place it inside the file "
                "(dtype, shape and data_offsets disagree)"
            )
        f.entries[tensor] = Entry(begin, end - begin, t["dtype"], shape)
    return f


def _check_header_entry(f: StoredFile, spec: TensorSpec, piece: Piece, where: str) -> None:
    e = f.entries.get(spec.name)
    if e is None or e.dtype != spec.dtype or e.shape != local_shape(spec, piece):
        got = "is missing" if e is None else f"is {e.dtype} {list(e.shape)}"
        raise CheckpointError(
            f"{where}[{spec.name!r}]: {got} there, but metadata.json has a chunk of "
            f"{spec.dtype} {list(local_shape(spec, piece))}"
        )

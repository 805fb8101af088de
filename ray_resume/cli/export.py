"""`export`: an iteration's weights (and optimizer state) as consolidated plain safetensors files."""

from __future__ import annotations

import json
import os

from ..checkpoint.format import paths
from ..checkpoint.format.schema import Iteration
from ..text_table import human_size
from ..errors import CliError
from .common import open_root, resolve_iteration, verify_iteration


EXPORT_FILES = ("model.safetensors", "optimizer.safetensors", paths.CONFIG, "config.json")


def cmd_export(args) -> int:
    import safetensors.torch  # heavy: only this command needs it

    from ..checkpoint.loader import load_state

    root = open_root(args.root)
    storage = root.storage
    out = args.out_dir
    if os.path.exists(out) and not os.path.isdir(out):
        raise CliError(f"{out!r} exists and is not a directory", 2)
    if os.path.isdir(out) and os.listdir(out) and not args.force:
        raise CliError(f"output directory {out!r} is not empty; choose an empty one or pass --force to overwrite", 2)
    step, _ = resolve_iteration(root, args.iteration)
    it = root.iteration(step)
    kinds = [paths.MODEL_KIND] + ([paths.OPTIM_KIND] if args.with_optimizer else [])
    if args.with_optimizer and not it.has_optimizer:
        raise CliError(
            f"{paths.join(it.path, paths.METADATA)}: iteration {step} has no optimizer state (saved with no_save_optim); drop --with-optimizer"
        )
    result = verify_iteration(storage, it)
    if not result["ok"]:
        raise CliError(f"iteration {step} failed verification, nothing exported: " + "; ".join(result["problems"]))
    os.makedirs(out, exist_ok=True)
    for name in EXPORT_FILES:  # --force: no stale file from an earlier export may survive
        if os.path.exists(os.path.join(out, name)):
            os.unlink(os.path.join(out, name))
    meta = {"format": "pt", "ray_resume_source": it.path, "ray_resume_iteration": str(step)}
    facts, why = export_facts(storage, it, args.rebuild_model)
    hf = facts.get("transformers")
    written = []
    for kind, filename in zip(kinds, ("model.safetensors", "optimizer.safetensors")):
        tensors = load_state(storage, it, kind)
        if kind == paths.MODEL_KIND:
            # The checkpoint stores a tied weight once; a strict load_state_dict wants every name (a copy each).
            tensors.update(
                {alias: tensors[first].clone() for alias, first in facts.get("tied", {}).items() if first in tensors}
            )
            if hf and hf["prefix"]:  # a wrapper's transformers model: its own names, as from_pretrained reads them
                tensors = {n[len(hf["prefix"]) :]: t for n, t in tensors.items() if n.startswith(hf["prefix"])}
        safetensors.torch.save_file(tensors, os.path.join(out, filename), metadata=meta)
        os.chmod(os.path.join(out, filename), 0o666 & ~_umask())  # safetensors creates 0600 files
        written.append(
            f"{filename} ({len(tensors)} tensors, {human_size(os.path.getsize(os.path.join(out, filename)))})"
        )
    config = paths.join(it.path, paths.CONFIG)
    if storage.exists(config):
        with open(os.path.join(out, paths.CONFIG), "wb") as f:
            f.write(storage.read_bytes(config))
        written.append(paths.CONFIG)
    if hf:  # from_pretrained(out) needs its config.json
        with open(os.path.join(out, "config.json"), "w") as f:
            f.write(json.dumps(hf["config"], indent=2, sort_keys=True) + "\n")
        written.append(
            f"config.json ({', '.join(hf['config']['architectures'])}"
            f"{', the tensors under ' + repr(hf['prefix']) if hf['prefix'] else ''})"
        )
    print(f"exported iteration {step} from {it.path} to {out}: " + ", ".join(written))
    if why:
        print(f"note: {why}")
    return 0


def export_facts(storage, it: Iteration, rebuild: bool) -> tuple[dict, str | None]:
    """What the export needs beyond the tensors (`state.export_facts`: tied names, a transformers
    config), as the iteration's metadata.json holds it since rank 0 took it from the live model; and
    why not, if it could not be had. `rebuild`: for an iteration saved without it (older ray_resume,
    MindFormers), build the model of its config.yaml on the meta device, importing its builder."""
    from ..checkpoint.format import state

    facts = it.ours.get("model")  # checked by parse.parse_ours
    if facts is not None:
        return facts, None
    if not rebuild:
        return {}, (
            "this iteration was saved without the model's export facts (tied names, a transformers config): "
            "a tied weight is stored under its first name only, and no config.json is written; "
            "--rebuild-model builds its model here to find them"
        )
    import torch
    import yaml

    from ..config import Config
    from ..plugins import make_model, resolve

    try:
        cfg = Config.from_dict(
            yaml.safe_load(storage.read_bytes(paths.join(it.path, paths.CONFIG))), source=paths.CONFIG
        )
        with torch.device("meta"):
            return state.export_facts(make_model(resolve(cfg), cfg)), None
    except Exception as exc:  # no config.yaml, a builder not importable here, one that needs real memory...
        return {}, (
            f"the model was not rebuilt here ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}): "
            "a tied weight is stored under its first name only, and no config.json is written"
        )


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask

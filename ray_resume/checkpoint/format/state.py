"""Training state <-> flat name->tensor dicts, and per-rank RNG state as text.

Optimizer state is keyed by parameter name, not by torch's positional index,
so a checkpoint stays readable when the model is wrapped differently.
"""

from __future__ import annotations

import base64
import itertools
import json
import random

import numpy as np
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from . import names
from ...errors import CheckpointError

# safetensors dtype tags <-> torch dtypes (the tags the safetensors format defines).
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_TAGS = {v: k for k, v in DTYPES.items()}


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside a DDP wrapper (FSDP2 shards the module in place: nothing to unwrap)."""
    return getattr(model, "module", model)


def dim0_sharded(t: torch.Tensor) -> bool:
    """An FSDP2 parameter or optimizer slot: a DTensor sharded on dim 0 over the whole (1-D) group."""
    if not isinstance(t, DTensor):
        return False
    if t.device_mesh.ndim != 1 or any(not isinstance(p, (Shard, Replicate)) for p in t.placements):
        raise ValueError(
            f"unsupported DTensor layout {t.placements} on a {t.device_mesh.ndim}-D mesh; only 1-D FSDP2 meshes are checkpointed"
        )
    return isinstance(t.placements[0], Shard) and t.placements[0].dim == 0


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (a plain tensor is all local)."""
    return t.to_local() if isinstance(t, DTensor) else t


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state by name, each tied (shared) tensor once, under its first name.

    safetensors refuses tensors that share storage, and a tied weight written
    under two names would store its bytes twice; `tied_aliases` restores it.
    """
    aliases = tied_aliases(model)
    return {name: t.detach() for name, t in unwrap(model).state_dict().items() if name not in aliases}


def with_rank0_buffers(model: torch.nn.Module, tensors: dict[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
    """`tensors` with every buffer (BatchNorm running stats...) replaced by a copy of rank 0's.

    Ranks update their buffers from their own data, so their values differ
    after a step; under DDP the next forward broadcasts rank 0's, which is
    what the uninterrupted run continues with. Saved from each rank's share
    as they stand, they would be stitched together from different ranks.
    The live buffers are left as they are (FSDP2 never broadcasts them:
    there, after a resume, every rank continues with rank 0's).
    """
    if not (torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1):
        return tensors
    names = sorted(n for n, _ in unwrap(model).named_buffers() if n in tensors and not isinstance(tensors[n], DTensor))
    copies = {}
    for name in names:  # the same order on every rank
        copy = tensors[name].detach().to(device, copy=True)
        torch.distributed.broadcast(copy, src=0)
        copies[name] = copy.to(tensors[name].device)
    return {**tensors, **copies}


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """{alias: first name} for state_dict entries that are the same tensor as an earlier one."""
    module = unwrap(model)
    # A meta-device model (the driver's check) has no storage to compare: tied tensors are one object.
    objects = dict(
        itertools.chain(module.named_parameters(remove_duplicate=False), module.named_buffers(remove_duplicate=False))
    )
    first: dict[tuple, str] = {}
    aliases = {}
    for name, t in module.state_dict().items():
        local = local_tensor(t)
        key = (
            (id(objects.get(name, t)),)
            if t.is_meta
            else (
                local.untyped_storage().data_ptr(),
                local.storage_offset(),
                tuple(t.shape),
                tuple(local.stride()),
                t.dtype,
            )
        )
        if key in first:
            aliases[name] = first[key]
        else:
            first[key] = name
    return aliases


def export_facts(model: torch.nn.Module) -> dict:
    """What an export needs of the live model, which the tensors alone do not say: the names its tied
    tensors also go by, and for a Hugging Face transformers model (the model, or the first module in
    it with a `config` that can `save_pretrained`) its config as `config.json` holds it, with
    `architectures`, and the prefix of its tensors' names in this model ("" when it is the model)."""
    module = unwrap(model)
    facts: dict = {"tied": tied_aliases(model)}
    for prefix, sub in module.named_modules():
        config = getattr(sub, "config", None)
        if callable(getattr(config, "to_json_string", None)) and callable(getattr(config, "save_pretrained", None)):
            as_json = json.loads(config.to_json_string(use_diff=False))
            # FSDP2's fully_shard swaps the class for a subclass named FSDP<class>: name the user's class
            cls = next(c for c in type(sub).__mro__ if not c.__name__.startswith("FSDP"))
            as_json["architectures"] = as_json.get("architectures") or [cls.__name__]
            facts["transformers"] = {"prefix": f"{prefix}." if prefix else "", "config": as_json}
            break
    return facts


def optim_tensors(named_params, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every slot the optimizer keeps for every (name, param), named as MindFormers names optimizer
    state (`names.state_name`: `adam_m.{param}`, `step.{param}`...): any torch.optim optimizer
    (AdamW's `max_exp_avg_sq` with amsgrad, SGD's `momentum_buffer`...). A number becomes a 0-d
    tensor; any other value is refused by name."""
    out: dict[str, torch.Tensor] = {}
    for name, param in named_params:
        for slot, value in optimizer.state.get(param, {}).items():
            if isinstance(value, bool) or not isinstance(value, (torch.Tensor, int, float)):
                raise CheckpointError(
                    f"optimizer state {names.state_name(name, slot)} is a {type(value).__name__}; only tensors "
                    "and numbers are checkpointed"
                )
            out[names.state_name(name, slot)] = value if torch.is_tensor(value) else torch.tensor(value)
    return out


def load_optim_tensors(named_params, optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor]) -> None:
    """Rebuild torch's positional optimizer state from tensors named as `optim_tensors` names them."""
    slots_of: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        name, slot = names.parse_state_name(key)
        slots_of.setdefault(name, {})[slot] = value
    state = {}
    for index, (name, param) in enumerate(named_params):
        if name in slots_of:
            state[index] = {slot: _like(param, value) for slot, value in slots_of[name].items()}
    optimizer.load_state_dict({"state": state, "param_groups": optimizer.state_dict()["param_groups"]})


def _like(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """An optimizer slot loaded as this rank's dim-0 chunk becomes a DTensor sharded like its FSDP param."""
    if isinstance(param, DTensor) and value.dim() == param.dim():
        local = value.to(local_tensor(param).device)
        return DTensor.from_local(
            local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride(), run_check=False
        )
    return value


def class_path(cls: type) -> str:
    """Where a class is defined, "module:Qualname" (what a checkpoint records of the optimizer)."""
    return f"{cls.__module__}:{cls.__qualname__}"


def optimizer_slots(optimizer: torch.optim.Optimizer | type, kwargs: dict | None = None) -> set[str] | None:
    """The state slots an optimizer keeps for a parameter (torch's names: AdamW's `step`, `exp_avg`,
    `exp_avg_sq`), from one step of its class, built as it was (or with `kwargs`), on a one-element
    parameter; None if that cannot run (an optimizer that wants more than parameters)."""
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    if kwargs is None:
        kwargs = {k: v for k, v in optimizer.defaults.items() if k not in ("params", "differentiable")}
    param = torch.nn.Parameter(torch.zeros(1))
    param.grad = torch.ones(1)
    try:
        probe = cls([param], **kwargs)
        probe.step()
    except Exception:  # noqa: BLE001  (a check that cannot run is no check)
        return None
    return set(probe.state[param])


def capture_rng() -> dict[str, str]:
    """This process's torch, numpy and python RNG states as strings."""
    _, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "rng_torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
        "rng_numpy": json.dumps([keys.tolist(), int(pos), int(has_gauss), float(gauss)]),
        "rng_python": json.dumps(_python_rng_state()),
        **(
            {"rng_cuda": base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()}
            if torch.cuda.is_available()
            else {}
        ),
    }


def _python_rng_state() -> dict:
    """`random`'s Mersenne Twister state and the second Gaussian of the last `gauss()` pair,
    which the next `gauss()` returns: without it a resumed run draws another value there."""
    version, internal, gauss_next = random.getstate()
    assert version == 3, f"unknown random state version {version}"
    return {"state": list(internal), "gauss_next": gauss_next}


def restore_rng(saved: dict[str, str]) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(saved["rng_torch"])), dtype=torch.uint8))
    keys, pos, has_gauss, gauss = json.loads(saved["rng_numpy"])
    np.random.set_state(("MT19937", np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    python = json.loads(saved["rng_python"])
    if isinstance(python, list):  # written before the Gaussian cache was kept: it had none to give
        python = {"state": python, "gauss_next": None}
    random.setstate((3, tuple(python["state"]), python["gauss_next"]))
    if "rng_cuda" in saved and torch.cuda.is_available():  # dropout on a GPU draws from the CUDA generator
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(saved["rng_cuda"])), dtype=torch.uint8))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)

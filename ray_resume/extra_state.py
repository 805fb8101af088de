"""What a train_func's state is besides the model and the optimizer's tensors: any torch.optim
optimizer as the checkpointer sees it (its named parameters, its slots, its param groups'
hyperparameters), and `extra` objects (LR schedulers, counters, generators) as JSON and
safetensors, without pickle."""

from __future__ import annotations

import base64
import json
from typing import Any

import safetensors.torch
import torch

from .checkpoint.format.state import load_optim_tensors, optim_tensors, unwrap
from .errors import ConfigError

MAX_EXTRA = 16 << 20  # bytes of JSON extra state per rank (it shares a 64 MiB safetensors header with the RNG)


class OptimizerState:
    """Any torch.optim optimizer over the model's parameters, as the Checkpointer saves and loads one."""

    scaler = None  # no loss scaling of ours: a GradScaler of yours goes into `extra`

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        names = {id(p): n for n, p in unwrap(model).named_parameters()}
        params = [p for group in optimizer.param_groups for p in group["params"]]
        unknown = [i for i, p in enumerate(params) if id(p) not in names]
        if unknown:
            raise ConfigError(
                f"optimizer parameter {unknown[0]} is not a parameter of the model; build the optimizer over "
                "model.parameters() (after prepare_model or fully_shard)"
            )
        self.optimizer = optimizer
        self.named = [(names[id(p)], p) for p in params]  # in the optimizer's order: its state is positional

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def named_main(self) -> list[tuple[str, torch.Tensor]]:
        return self.named

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return optim_tensors(self.named, self.optimizer)

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        load_optim_tensors(self.named, self.optimizer, tensors)

    def reload_main_params_from_model(self) -> None:
        pass  # the model's parameters are the ones it steps

    def groups(self) -> list[dict]:
        """Every param group's hyperparameters (lr, momentum, betas...), as JSON values."""
        out = []
        for i, group in enumerate(self.optimizer.param_groups):
            values = {}
            for key, value in group.items():
                if key == "params":
                    continue
                if torch.is_tensor(value) and value.numel() == 1:
                    value = value.item()
                if not (
                    value is None
                    or isinstance(value, (bool, int, float, str))
                    or (isinstance(value, (list, tuple)) and all(isinstance(v, (bool, int, float, str)) for v in value))
                ):
                    raise ConfigError(
                        f"optimizer.param_groups[{i}][{key!r}] is a {type(value).__name__}; only numbers, "
                        "strings, bools, None and lists of them are checkpointed"
                    )
                values[key] = value
            out.append(values)
        return out

    def load_groups(self, saved: list[dict]) -> None:
        live = self.optimizer.param_groups
        if len(saved) != len(live):
            raise ConfigError(
                f"the checkpoint's optimizer has {len(saved)} param groups, this one {len(live)}; build it as it was"
            )
        for group, values in zip(live, saved):
            for key, value in values.items():
                old = group.get(key)
                if torch.is_tensor(old):
                    old.fill_(value)  # a tensor hyperparameter (capturable lr) stays a tensor
                else:
                    group[key] = tuple(value) if isinstance(old, tuple) else value


def dump_extra(extra: dict[str, Any]) -> str:
    """Each object's state (a torch.Generator's, or its state_dict()) as JSON, tensors in one safetensors blob."""
    tensors: dict[str, torch.Tensor] = {}
    states = {
        key: _encode(
            obj.get_state() if isinstance(obj, torch.Generator) else obj.state_dict(), f"extra[{key!r}]", tensors
        )
        for key, obj in extra.items()
    }
    blob = safetensors.torch.save(tensors) if tensors else b""
    return json.dumps({"state": states, "tensors": base64.b64encode(blob).decode()}, sort_keys=True)


def load_extra(extra: dict[str, Any], text: str, where: str | None) -> None:
    saved = json.loads(text)
    tensors = safetensors.torch.load(base64.b64decode(saved["tensors"])) if saved["tensors"] else {}
    missing = sorted(set(extra) - set(saved["state"]))
    if missing:
        raise ConfigError(
            f"{where}: holds no extra state {missing[0]!r} (it has {sorted(saved['state'])}); pass the keys it was saved with"
        )
    for key, obj in extra.items():
        state = _decode(saved["state"][key], tensors)
        obj.set_state(state) if isinstance(obj, torch.Generator) else obj.load_state_dict(state)


def _encode(value, path: str, tensors: dict[str, torch.Tensor]):
    if torch.is_tensor(value):
        name = str(len(tensors))
        tensors[name] = value.detach().cpu().contiguous().clone()
        return {"__tensor__": name}
    if isinstance(value, dict):
        return {
            "__items__": [
                [_encode(k, f"{path} key", tensors), _encode(v, f"{path}[{k!r}]", tensors)] for k, v in value.items()
            ]
        }
    if isinstance(value, (list, tuple)):
        items = [_encode(v, f"{path}[{i}]", tensors) for i, v in enumerate(value)]
        return {"__tuple__": items} if isinstance(value, tuple) else items
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise ConfigError(
        f"{path} is a {type(value).__name__}; extra state may hold tensors, numbers, strings, bools, None, "
        "and lists, tuples and dicts of them (no pickle)"
    )


def _decode(value, tensors: dict[str, torch.Tensor]):
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    if isinstance(value, dict):
        if "__tensor__" in value:
            return tensors[value["__tensor__"]]
        if "__tuple__" in value:
            return tuple(_decode(v, tensors) for v in value["__tuple__"])
        return {_decode(k, tensors): _decode(v, tensors) for k, v in value["__items__"]}
    return value

"""What a checkpoint must fit before it loads: the model's tensor names, shapes and dtypes, the
optimizer's class and slots. The driver checks the built-in job's before any rank starts
(`preflight`), the ranks any job's as they restore (`checkpointer`); both say the same words."""

from __future__ import annotations

import torch

from ...errors import CheckpointError
from . import names, paths
from .plan import TensorSpec
from .state import DTYPE_TAGS, DTYPES, class_path


def check_weights(
    live: dict[str, torch.Tensor], saved: dict[str, TensorSpec], aliases: dict[str, str], where: str
) -> None:
    """Names, shapes and dtypes of the saved weights against the model's, naming the first misfit."""
    for name, tensor in live.items():
        if name not in saved:
            raise CheckpointError(
                f"{where}: model tensor {name!r} is missing{prefix_hint(set(live), set(saved) - set(aliases))}; "
                "the model config differs from the one that saved it"
            )
        got = saved[name]
        if got.shape != tuple(tensor.shape) or got.dtype != DTYPE_TAGS.get(tensor.dtype):
            raise CheckpointError(
                f"{where}: tensor {name!r} is {DTYPES.get(got.dtype, got.dtype)} {list(got.shape)} there but "
                f"{tensor.dtype} {list(tensor.shape)} in the model; the model config differs from the one that saved it"
            )
    extra = sorted(set(saved) - set(live) - set(aliases))
    if extra:
        raise CheckpointError(f"{where}: tensor {extra[0]!r} is not a tensor of the model")


def refuse_optimizer_change(it, cls: type, ours: str, start: str, back: str, *, slots: set[str] | None) -> None:
    """Another optimizer class cannot take the saved state (AdamW's moments are not SGD's momentum):
    torch would load the foreign slots without a word. Refused (the driver says it for the built-in
    job, the ranks for any), naming both classes; weights alone carry over. A checkpoint MindFormers
    wrote names no class: its slots must be ones the optimizer keeps (`slots`, None: unknown)."""
    saved, now = it.ours.get("optimizer"), class_path(cls)
    if saved is not None and saved != now:  # None: written before the class was kept, or by MindFormers
        raise CheckpointError(
            f"{paths.join(it.path, paths.METADATA)}: iteration {it.step} holds the state of optimizer {saved}, but "
            f"{ours.format(now=now)}; set checkpoint.no_load_optim: true to start {start.format(now=now)}, or {back}"
        )
    if it.origin == "mindformers" and it.has_optimizer:
        refuse_foreign_slots(
            it.specs(paths.OPTIM_KIND),
            slots,
            f"{paths.join(it.path, paths.METADATA)}: iteration {it.step}",
            ours.format(now=now),
            start.format(now=now),
            back,
        )


def refuse_foreign_slots(saved, slots: set[str] | None, where: str, ours: str, start: str, back: str) -> None:
    """A checkpoint that names no optimizer class (MindFormers', DCP's): every saved slot (`saved`,
    names as `names.state_name` gives them) must be one the optimizer keeps (`slots`; None: unknown)."""
    if slots is None:
        return
    for name in saved:
        param, slot = names.parse_state_name(name)
        if param is not None and slot not in slots | {names.MAIN_PARAM}:
            raise CheckpointError(
                f"{where} holds optimizer state {name!r} (torch's {slot!r}), but {ours}, which keeps "
                f"{sorted(slots)}; set checkpoint.no_load_optim: true to start {start}, or {back}"
            )


def check_optimizer_state(saved: dict[str, TensorSpec], params: dict[str, tuple[int, ...]], where: str) -> None:
    """Every saved slot belongs to a parameter of the model: a moment or a main param of its shape (a
    0-d step of any). Found on the driver for the built-in job, by the ranks for any."""
    for name, spec in saved.items():
        param, slot = names.parse_state_name(name)
        if param not in params:
            raise CheckpointError(
                f"{where}: optimizer tensor {name!r} is of parameter {param!r}, which the model lacks; "
                "the model config differs from the one that saved it"
            )
        if spec.shape and spec.shape != params[param]:
            raise CheckpointError(
                f"{where}: optimizer tensor {name!r} is {list(spec.shape)} there but parameter {param!r} is "
                f"{list(params[param])} in the model; the model config differs from the one that saved it"
            )


def prefix_hint(model_names: set[str], saved_names: set[str]) -> str:
    """Where the two sets of names differ by one leading module path (`transformer.` and none, as
    between a Hugging Face `GPT2LMHeadModel` and its `GPT2Model`), a sentence saying so."""
    for longer, shorter, says in (
        (
            saved_names,
            model_names,
            "the saved names are the model's with {p!r} in front: they are of a model that holds yours as .{m}",
        ),
        (
            model_names,
            saved_names,
            "the model's names are the saved ones with {p!r} in front: your model holds the saved one as .{m}",
        ),
    ):
        for prefix in sorted({n.split(".", 1)[0] + "." for n in longer if "." in n}):  # every leading module's
            if shorter and {n[len(prefix) :] for n in longer if n.startswith(prefix)} >= shorter:
                return " (" + says.format(p=prefix, m=prefix[:-1]) + ")"
    return ""

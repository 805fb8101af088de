"""What a tensor and its dtype are called on disk, as MindSpore Transformers (MindFormers) calls them.

Optimizer state is stored as `{slot}.{parameter}`, the form MindFormers gives its own: Adam's
moments are `adam_m.{p}` and `adam_v.{p}` (torch's `exp_avg`, `exp_avg_sq`), the fp32 main
parameter of a bf16/fp16 model is `main_param.{p}`; every other slot keeps torch's name in front
(`step.{p}`, `max_exp_avg_sq.{p}`, SGD's `momentum_buffer.{p}`, Adagrad's `sum.{p}`). A name
without a dot is the optimizer's own, not a parameter's (MindFormers writes `global_step` and
`learning_rate`). Pure: no torch, no I/O.
"""

from __future__ import annotations

# torch's slot -> the name MindFormers gives it; the other slots are written as torch names them.
RENAMED = {"exp_avg": "adam_m", "exp_avg_sq": "adam_v"}
TORCH_SLOT = {disk: slot for slot, disk in RENAMED.items()}
MAIN_PARAM = "main_param"  # the fp32 copy an optimizer steps under a low-precision model
STEP = "step"
GLOBAL_STEP = "global_step"  # MindFormers' optimizer step count: one for all parameters

# safetensors dtype tag -> (bytes per element, MindSpore's name, which MindFormers' metadata.json uses)
DTYPES = {
    "F64": (8, "Float64"),
    "F32": (4, "Float32"),
    "F16": (2, "Float16"),
    "BF16": (2, "BFloat16"),
    "I64": (8, "Int64"),
    "I32": (4, "Int32"),
    "I16": (2, "Int16"),
    "I8": (1, "Int8"),
    "U8": (1, "UInt8"),
    "BOOL": (1, "Bool"),
}
TAG_OF_MINDSPORE = {ms.lower(): tag for tag, (_, ms) in DTYPES.items()}


def state_name(param: str, slot: str) -> str:
    """The on-disk name of optimizer slot `slot` (torch's name, or MAIN_PARAM) of parameter `param`."""
    return f"{RENAMED.get(slot, slot)}.{param}"


def parse_state_name(name: str) -> tuple[str | None, str]:
    """(parameter, torch slot) of an optimizer tensor's name; (None, name) for the optimizer's own."""
    if "." not in name:
        return None, name
    prefix, param = name.split(".", 1)
    return param, TORCH_SLOT.get(prefix, prefix)


def itemsize(tag: str) -> int:
    return DTYPES[tag][0]


def mindspore_dtype(tag: str) -> str:
    return DTYPES[tag][1]


def tag_of(mindspore: str) -> str | None:
    """The safetensors tag of a MindSpore dtype name ("Float32" -> "F32"); None if we hold no such dtype."""
    return TAG_OF_MINDSPORE.get(str(mindspore).lower())

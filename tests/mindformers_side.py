"""MindSpore Transformers' own code on the other side of the format: what its loader reads of a root,
and roots its saver writes. tests/test_mindformers.py runs this in a process of its own (MindSpore
beside torch and Ray in one process is not what either expects):

    python tests/mindformers_side.py load ROOT OUT [--weights-only]
        get_checkpoint_path, CommonInfo.load_common and load_checkpoint(ROOT, net, optimizer) as a
        MindFormers user calls them; OUT.safetensors: every parameter of the net and the optimizer
        after the load; OUT.json: the path it chose and the CommonInfo it read.
    python tests/mindformers_side.py save ROOT OUT --steps N --gbs G
        N real AdamWeightDecay steps, then save_checkpoint (one card, as its trainer calls it);
        OUT.safetensors: what the net and optimizer held when saved.
    python tests/mindformers_side.py save-cards ROOT OUT --steps N --gbs G
        The same training, saved as two cards would: the model whole on both (a data-parallel copy),
        Adam's moments cut in dim-0 halves (optimizer parallel), and metadata.json written by its
        own save_metadata from its own ShardedTensors and Layouts.

The net is `TwoDense` of tests/plugin_models.py in MindSpore: fc1 = Dense(features, hidden),
fc2 = Dense(hidden, 1), the same parameter names and shapes.

MindFormers 2.1.0 imports its whole model zoo from `mindformers/__init__.py`: its checkpoint
modules are imported on their own, under empty `mindformers` and `mindformers.core` packages over
the installed folder. MindSpore runs in graph mode on the CPU, set in MindFormers' own context:
its save asks `LayoutAdapter.is_pynative_mode()`, which reads that context, not MindSpore's.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import sys
import types

FEATURES, HIDDEN = 64, 512


def import_mindformers():
    spec = importlib.util.find_spec("mindformers")
    if spec is None:
        sys.exit("mindformers is not installed: bash scripts/setup.sh --test installs it (--no-deps, see the script)")
    root = spec.submodule_search_locations[0]
    for name, sub in (("mindformers", ""), ("mindformers.core", "core")):
        package = types.ModuleType(name)
        package.__path__ = [os.path.join(root, sub)]
        package.__version__ = "2.1.0"
        sys.modules[name] = package
    import mindformers.tools  # noqa: F401  (before its context: that is the order mindformers/__init__ imports them in)
    from mindformers.core.context import build_context

    build_context({"context": {"mode": "GRAPH_MODE", "device_target": "CPU"}, "parallel": {}})


def net_and_optimizer():
    import mindspore as ms
    from mindspore import nn, ops

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Dense(FEATURES, HIDDEN)
            self.fc2 = nn.Dense(HIDDEN, 1)

        def construct(self, x):
            return self.fc2(ops.relu(self.fc1(x)))

    ms.set_seed(1)
    net = Net()
    return net, nn.AdamWeightDecay(net.trainable_params(), learning_rate=1e-3)


def dump(out: str, cells) -> None:
    """Every parameter of `cells` (net, optimizer), by name, as MindSpore holds it now."""
    from safetensors.numpy import save_file

    seen = {}
    for cell in cells:
        for name, param in cell.parameters_dict().items():
            seen[name] = param.asnumpy().copy()
    save_file(seen, out + ".safetensors")


def load(root: str, out: str, weights_only: bool) -> None:
    from mindformers.checkpoint.checkpoint import CommonInfo, get_checkpoint_path, load_checkpoint

    path = get_checkpoint_path(root, require_optimizer=not weights_only)
    common = CommonInfo.load_common(os.path.join(path, "common.json"))
    net, optimizer = net_and_optimizer()
    load_checkpoint(root, net, None if weights_only else optimizer)
    dump(out, [net] if weights_only else [net, optimizer])
    with open(out + ".json", "w") as f:
        json.dump({"path": path, "common": dataclasses.asdict(common)}, f)


def train(steps: int, gbs: int):
    import numpy as np
    import mindspore as ms
    from mindspore import nn

    net, optimizer = net_and_optimizer()
    step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), optimizer)
    rng = np.random.default_rng(0)
    for _ in range(steps):
        x = ms.Tensor(rng.normal(size=(gbs, FEATURES)).astype(np.float32))
        y = ms.Tensor(rng.normal(size=(gbs, 1)).astype(np.float32))
        step(x, y)
    return net, optimizer


def common_info(steps: int, gbs: int):
    from mindformers.checkpoint.checkpoint import CommonInfo

    return CommonInfo(
        epoch_num=0,
        step_num=steps,
        global_step=steps,
        loss_scale=1.0,
        global_batch_size=gbs,
        consumed_samples=steps * gbs,
        ckpt_status=0,
    )


def save(root: str, out: str, steps: int, gbs: int) -> None:
    from mindformers.checkpoint.checkpoint import save_checkpoint

    net, optimizer = train(steps, gbs)
    dump(out, [net, optimizer])
    save_checkpoint(steps, net, optimizer, common_info=common_info(steps, gbs), save_checkpoint_path=root)


def save_cards(root: str, out: str, steps: int, gbs: int) -> None:
    """Two cards' shards and MindFormers' metadata.json (its save_metadata, its ShardedTensors)."""
    import mindspore as ms
    from mindspore.parallel import Layout
    from mindformers.checkpoint.metadata import save_metadata
    from mindformers.checkpoint.sharded_tensor import build_sharded_tensor
    from mindformers.checkpoint.utils import (
        get_checkpoint_iter_dir,
        get_checkpoint_name,
        get_checkpoint_tracker_filename,
        FileType,
    )

    net, optimizer = train(steps, gbs)
    dump(out, [net, optimizer])
    directory = get_checkpoint_iter_dir(os.path.realpath(root), steps)
    os.makedirs(directory)
    world, metas, mappings = 2, {0: {}, 1: {}}, []
    model_keys = set(net.parameters_dict())
    halves = Layout((world,), ("dp",), list(range(world)))
    files = {}
    for name, param in {**net.parameters_dict(), **optimizer.parameters_dict()}.items():
        value = param.asnumpy()
        if not name.startswith(("adam_m.", "adam_v.")) and name not in model_keys:
            continue  # global_step, learning_rate: load_checkpoint takes the step from common.json
        kind = FileType.MODEL if name in model_keys else FileType.OPTIMIZER
        moment = kind == FileType.OPTIMIZER and value.shape[0] % world == 0
        for rank in range(world):
            file = get_checkpoint_name(None, "ckpt", rank, world, kind) + ".safetensors"
            if not moment and kind == FileType.OPTIMIZER and rank:
                continue  # a moment of too few rows to cut: whole, on card 0
            if moment:  # this card's half of the rows, as optimizer parallelism shards it
                rows = value.shape[0] // world
                offset = (rank * rows,) + (0,) * (value.ndim - 1)
                local = value[rank * rows : (rank + 1) * rows]
                layout = halves("dp", *(["None"] * (value.ndim - 1)))
                group = [rank]
            else:  # the whole model on every card, a data-parallel copy
                offset, local, layout, group = (0,) * value.ndim, value, None, list(range(world))
            metas[rank][name] = build_sharded_tensor(
                param_name=name,
                param_dtype=param.dtype,
                local_shape=local.shape,
                global_shape=value.shape,
                global_offset=offset,
                axis_fragmentations=[world if moment else 1] + [1] * (value.ndim - 1),
                layout=layout,
            )
            mappings.append((file, rank, group, (name, offset)))
            files.setdefault(file, []).append({"name": name, "data": ms.Tensor(local)})
    for file, params in files.items():
        ms.save_checkpoint(params, os.path.join(directory, file[: -len(".safetensors")]), format="safetensors")
    save_metadata(metas, mappings, os.path.join(directory, "metadata.json"))
    common_info(steps, gbs).save_common(os.path.join(directory, "common.json"))
    with open(get_checkpoint_tracker_filename(os.path.realpath(root)), "w") as f:
        f.write(str(steps))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python tests/mindformers_side.py")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("load")
    p.add_argument("root")
    p.add_argument("out")
    p.add_argument("--weights-only", action="store_true")
    for name in ("save", "save-cards"):
        p = sub.add_parser(name)
        p.add_argument("root")
        p.add_argument("out")
        p.add_argument("--steps", type=int, default=3)
        p.add_argument("--gbs", type=int, default=8)
    args = parser.parse_args()
    import_mindformers()
    if args.command == "load":
        load(args.root, args.out, args.weights_only)
    elif args.command == "save":
        save(args.root, args.out, args.steps, args.gbs)
    else:
        save_cards(args.root, args.out, args.steps, args.gbs)


if __name__ == "__main__":
    main()

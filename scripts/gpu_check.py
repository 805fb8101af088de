"""The GPU check: the checkpoint core on one device, without Ray (issue 23, part 1).

    python scripts/gpu_check.py --out DIR                            # a GPU: ~1B-parameter GPT, NCCL
    python scripts/gpu_check.py --out DIR --device cpu --size tiny   # the same checks on CPU with gloo (tests/test_gpu_check.py)

Runs the real `Checkpointer` (snapshot, writer, restore, loader) in a
`torch.distributed` group of world size 1 (NCCL on a GPU, gloo on CPU). Its
reports go to `LocalController`, which commits with the driver's own
`commit_iteration`, as the job's controller does. Writes DIR/gpu_check.json and
prints one line per part:

- speed: the GPT in bf16 with fp32 main params and AdamW, on the device:
  ours sync save (to commit), async save (stall = device -> pinned host
  snapshot, then save to commit) and a verified load, against torch DCP
  `save` / `async_save` / `load` of the same state on the same device, with ratios;
- exact: train k steps, save, go on to n and save; a fresh process loads step
  k and goes on to n: the shard files of step n must be equal byte for byte
  (model, optimizer, and every RNG, CUDA's included, in the opt header), with
  `torch.use_deterministic_algorithms(True)`; also what determinism costs;
- fsdp: the same with the model under FSDP2 `fully_shard`.

Needs torch, safetensors, pyarrow, pyyaml, pydantic, numpy and xxhash; not Ray.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS; must precede CUDA's start
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the device gets the working tree, not an installed package

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.page_cache import drop_cache  # noqa: E402
from ray_resume.checkpoint.format import paths
from ray_resume.checkpoint.checkpointer import Checkpointer  # noqa: E402
from ray_resume.checkpoint.root import CommittedIteration  # noqa: E402
from ray_resume.checkpoint.commit import commit_iteration  # noqa: E402
from ray_resume.checkpoint.io.storage import LocalStorage
from ray_resume.config import Config  # noqa: E402
from ray_resume.faults import FaultInjector  # noqa: E402
from ray_resume.model import GPT, lm_loss  # noqa: E402
from ray_resume.optim import MainParamsOptimizer  # noqa: E402
from ray_resume.parallel import wrap  # noqa: E402

SIZES = {  # name: (vocab_size, seq_len, d_model, n_layers, n_heads)
    "tiny": (256, 16, 64, 2, 4),
    "small": (4096, 64, 256, 4, 4),
    "1b": (32768, 128, 2048, 20, 16),  # 1.07B parameters
}
BATCH = 4


class LocalController:
    """The job controller's part a 1-rank save needs: commit each reported iteration (`commit_iteration`)."""

    def __init__(self, root: str, config: dict):
        self.root, self.config = root, config
        self.committed = 0

    def report(self, attempt: int, step: int, manifest, common: dict) -> bool:
        commit_iteration(
            LocalStorage(), self.root, step, [manifest], common, prefix="ckpt", config=self.config, job_id="gpu-check"
        )
        self.committed = step
        return True


def config(root: str, size: str, *, async_save: bool, dropout: float) -> Config:
    vocab, seq, d, layers, heads = SIZES[size]
    return Config.from_dict(
        {
            "name": "gpu-check",
            "model": {
                "vocab_size": vocab,
                "seq_len": seq,
                "d_model": d,
                "n_layers": layers,
                "n_heads": heads,
                "dtype": "bfloat16",
                "dropout": dropout,
            },
            "data": {"path": os.path.join(root, "unused-data")},
            "training": {
                "global_batch_size": BATCH,
                "micro_batch_size": BATCH,
                "train_steps": 10**9,
                "lr": 1e-4,
                "seed": 0,
            },
            "scaling": {"num_workers": 1},
            "checkpoint": {
                "save_path": root,
                "save_interleaved_steps": 10**9,
                "save_max": 1000,
                "async_save": async_save,
            },
        }
    )


def start_group(device: torch.device) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1
    )


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(cfg: Config, device: torch.device, strategy: str, seed: int):
    m = cfg.model
    torch.manual_seed(seed)
    model = GPT(m.vocab_size, m.seq_len, m.d_model, m.n_layers, m.n_heads, m.dropout).to(
        device=device, dtype=torch.bfloat16
    )
    if strategy == "fsdp":
        model = wrap(model, "fsdp", [], device, 1)
    return model, MainParamsOptimizer(model, lr=cfg.training.lr, weight_decay=0.01)


def train_step(model, optimizer, cfg: Config, step: int, device: torch.device) -> float:
    """One optimizer step on a batch that is a pure function of `step`."""
    ids = torch.randint(
        0, cfg.model.vocab_size, (BATCH, cfg.model.seq_len + 1), generator=torch.Generator().manual_seed(1000 + step)
    )
    optimizer.zero_grad()
    loss = lm_loss(model, ids.to(device))
    optimizer.backward(loss)
    optimizer.step()
    return float(loss.detach())


def common_of(step: int) -> dict:
    return {
        "global_step": step,
        "global_batch_size": BATCH,
        "consumed_samples": BATCH * step,
        "epoch_num": 0,
        "step_num": step,
        "loss_scale": 1.0,
    }


def checkpointer(cfg: Config, root: str) -> tuple[Checkpointer, LocalController]:
    controller = LocalController(root, cfg.to_dict())
    return Checkpointer(cfg.checkpoint, controller, 0, 1, 0, FaultInjector(None, 0, lambda: False)), controller


def save(ck: Checkpointer, model, optimizer, step: int, device: torch.device) -> dict:
    sync(device)
    start = time.perf_counter()
    ck.save(step, model, optimizer, common_of(step))
    stall = time.perf_counter() - start
    ck.close()
    return {"stall_s": stall, "save_s": time.perf_counter() - start}


def file_bytes(root: str, step: int) -> dict[str, bytes]:
    d = Path(paths.iteration_dir(root, step))
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if paths.parse_shard_filename(p.name)}


# ----------------------------------------------------------------------------- speed


def speed(size: str, device: torch.device, work: str) -> dict:
    import torch.distributed.checkpoint as dcp

    from ray_resume.checkpoint.format import state

    root = os.path.join(work, "speed")
    cfg = config(root, size, async_save=False, dropout=0.0)
    model, optimizer = build(cfg, device, "plain", seed=0)
    train_step(model, optimizer, cfg, 1, device)  # Adam's slots exist
    out: dict = {"params": sum(p.numel() for p in model.parameters())}
    # One checkpoint on disk at a time (~15 GB at 1b; the device has 64 GiB).
    ours_sync, _ = checkpointer(cfg, root)
    out["ours_sync"] = save(ours_sync, model, optimizer, 1, device)
    out["checkpoint_bytes"] = sum(len(b) for b in file_bytes(root, 1).values())
    shutil.rmtree(paths.iteration_dir(root, 1))
    ours_async, _ = checkpointer(config(root, size, async_save=True, dropout=0.0), root)
    out["ours_async_first"] = save(ours_async, model, optimizer, 2, device)  # allocates the pinned snapshot
    shutil.rmtree(paths.iteration_dir(root, 2))
    out["ours_async"] = save(ours_async, model, optimizer, 3, device)
    fresh, fresh_opt = build(cfg, device, "plain", seed=1)
    train_step(fresh, fresh_opt, cfg, 1, device)  # a live optimizer, as DCP needs one to load into
    drop_cache(root)
    sync(device)
    start = time.perf_counter()
    point, _ = ours_sync.restore(fresh, fresh_opt, CommittedIteration(root, 3), full=True)
    sync(device)
    out["ours_load_s"] = time.perf_counter() - start
    out["ours_load_bytes_read"] = point.bytes_read
    out["ours_load_equal"] = all(
        torch.equal(a, b) for a, b in zip(state.model_tensors(model).values(), state.model_tensors(fresh).values())
    )
    del fresh, fresh_opt
    shutil.rmtree(root)

    live = {"model": state.model_tensors(model), "optim": optimizer.state_tensors()}
    dcp_dir = os.path.join(work, "dcp")
    sync(device)
    start = time.perf_counter()
    dcp.save(live, checkpoint_id=dcp_dir + "-sync")
    out["dcp_save_s"] = time.perf_counter() - start
    sync(device)
    start = time.perf_counter()
    future = dcp.async_save(live, checkpoint_id=dcp_dir + "-async")
    out["dcp_async_stall_s"] = time.perf_counter() - start
    (future.upload_completion if hasattr(future, "upload_completion") else future).result()
    out["dcp_async_save_s"] = time.perf_counter() - start
    shutil.rmtree(dcp_dir + "-async")
    drop_cache(dcp_dir + "-sync")
    sync(device)
    start = time.perf_counter()
    dcp.load(live, checkpoint_id=dcp_dir + "-sync")
    sync(device)
    out["dcp_load_s"] = time.perf_counter() - start
    shutil.rmtree(dcp_dir + "-sync")

    out["ours_sync_save_vs_dcp_save"] = out["ours_sync"]["save_s"] / out["dcp_save_s"]
    out["ours_async_stall_vs_dcp_async_stall"] = out["ours_async"]["stall_s"] / out["dcp_async_stall_s"]
    out["ours_async_stall_vs_ours_sync_save"] = out["ours_async"]["stall_s"] / out["ours_sync"]["save_s"]
    out["ours_load_vs_dcp_load"] = out["ours_load_s"] / out["dcp_load_s"]
    out["ours_save_gbps"] = out["checkpoint_bytes"] / out["ours_sync"]["save_s"] / 1e9
    return out


# ----------------------------------------------------------------------------- exactness


def exact_run(size: str, device: torch.device, strategy: str, root: str, k: int, n: int, resume: bool) -> dict:
    """Steps 1..n saving k and n, or (resume) load k and run k+1..n saving n; the losses of the steps run."""
    torch.use_deterministic_algorithms(True)
    cfg = config(root, size, async_save=True, dropout=0.1)  # dropout draws on the device's RNG
    model, optimizer = build(cfg, device, strategy, seed=7 if resume else 0)
    ck, _ = checkpointer(cfg, root)
    first = 1
    if resume:
        point, _ = ck.restore(
            model, optimizer, CommittedIteration(os.path.join(os.path.dirname(root), "reference"), k), full=True
        )
        first = point.step + 1
    model.train()
    losses = {}
    for step in range(first, n + 1):
        losses[step] = train_step(model, optimizer, cfg, step, device)
        if step in (k, n):
            ck.save(step, model, optimizer, common_of(step))
    ck.close()
    return losses


def exact(size: str, device: torch.device, strategy: str, work: str, k: int = 3, n: int = 6) -> dict:
    base = os.path.join(work, f"exact-{strategy}")
    reference = exact_run(size, device, strategy, os.path.join(base, "reference"), k, n, resume=False)
    # The resume runs in a fresh process, as after a crash: nothing of this one's state carries over.
    proc = subprocess.run(
        [
            sys.executable,
            __file__,
            "--phase",
            "resume",
            "--device",
            str(device),
            "--size",
            size,
            "--strategy",
            strategy,
            "--work",
            work,
            "--k",
            str(k),
            "--n",
            str(n),
        ],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    if proc.returncode != 0:
        return {"equal": False, "error": (proc.stdout + proc.stderr)[-4000:]}
    resumed = {int(s): v for s, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}
    a, b = file_bytes(os.path.join(base, "reference"), n), file_bytes(os.path.join(base, "resumed"), n)
    differ = sorted(name for name in a.keys() | b.keys() if a.get(name) != b.get(name))
    shutil.rmtree(base)
    return {
        "k": k,
        "n": n,
        "files": sorted(a),
        "differ": differ,
        "equal": not differ and bool(a),
        "losses_equal": all(resumed[s] == reference[s] for s in resumed),
        "losses": reference,
        "resumed_losses": resumed,
    }


def determinism_cost(size: str, device: torch.device, steps: int = 10) -> dict:
    """Seconds per step with and without torch.use_deterministic_algorithms (after a warm-up step)."""
    out = {}
    for flag in (False, True):
        torch.use_deterministic_algorithms(flag)
        cfg = config(tempfile.gettempdir(), size, async_save=True, dropout=0.1)
        model, optimizer = build(cfg, device, "plain", seed=0)
        train_step(model, optimizer, cfg, 0, device)
        sync(device)
        start = time.perf_counter()
        for step in range(1, steps + 1):
            train_step(model, optimizer, cfg, step, device)
        sync(device)
        out["deterministic_step_s" if flag else "default_step_s"] = (time.perf_counter() - start) / steps
        del model, optimizer
    torch.use_deterministic_algorithms(False)
    out["deterministic_vs_default"] = out["deterministic_step_s"] / out["default_step_s"]
    return out


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="directory for gpu_check.json")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--size", default=None, help=f"speed part's model: {', '.join(SIZES)} (default 1b on a GPU, tiny on CPU)"
    )
    p.add_argument(
        "--exact-size", default=None, help="model of the exactness parts (default small on a GPU, tiny on CPU)"
    )
    p.add_argument("--work", default=None, help="where checkpoints are written (default: a temp dir)")
    p.add_argument("--phase", default="all", choices=["all", "resume"], help=argparse.SUPPRESS)
    p.add_argument("--strategy", default="plain", help=argparse.SUPPRESS)
    p.add_argument("--k", type=int, default=3, help=argparse.SUPPRESS)
    p.add_argument("--n", type=int, default=6, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    device = torch.device(args.device if args.device != "cuda" else "cuda:0")
    start_group(device)
    try:
        if args.phase == "resume":  # the fresh process of `exact`
            root = os.path.join(args.work, f"exact-{args.strategy}", "resumed")
            print(json.dumps(exact_run(args.size, device, args.strategy, root, args.k, args.n, resume=True)))
            return 0
        gpu = device.type == "cuda"
        size, exact_size = args.size or ("1b" if gpu else "tiny"), args.exact_size or ("small" if gpu else "tiny")
        work = args.work or tempfile.mkdtemp(prefix="gpu-check-")
        results: dict = {
            "date": time.strftime("%Y-%m-%d"),
            "device": torch.cuda.get_device_name(device) if gpu else "cpu",
            "torch": torch.__version__,
            "backend": dist.get_backend(),
            "size": size,
            "exact_size": exact_size,
        }
        parts = [
            ("exact", lambda: exact(exact_size, device, "plain", work)),
            ("fsdp", lambda: exact(exact_size, device, "fsdp", work)),
            ("determinism", lambda: determinism_cost(exact_size, device)),
            ("speed", lambda: speed(size, device, work)),
        ]
        for name, part in parts:
            start = time.perf_counter()
            try:
                results[name] = part()
            except Exception as exc:  # one part's failure is a result too; the others still run
                results[name] = {"error": f"{type(exc).__name__}: {exc}"}
            results[name]["part_s"] = time.perf_counter() - start
            print(f"[gpu-check] {name}: {summary(name, results[name])}", flush=True)
            write(args.out, results)
        results["ray_imported"] = "ray" in sys.modules  # the device has no Ray: nothing here may need it
        ok = all("error" not in results[n] for n, _ in parts) and results["exact"]["equal"] and results["fsdp"]["equal"]
        write(args.out, results)
        print(f"[gpu-check] {'every check held' if ok else 'FAILED'}; results in {args.out or '(no --out)'}")
        return 0 if ok else 1
    finally:
        dist.destroy_process_group()


def summary(name: str, r: dict) -> str:
    if "error" in r:
        return "ERROR " + r["error"].splitlines()[-1][:300]
    if name in ("exact", "fsdp"):
        return (
            f"steps 1..{r['n']} vs load {r['k']} + {r['k'] + 1}..{r['n']} in a fresh process: "
            + ("shard bytes equal" if r["equal"] else f"DIFFER in {r['differ']}")
            + f", losses {'equal' if r['losses_equal'] else 'DIFFER'}"
        )
    if name == "determinism":
        return f"{r['default_step_s'] * 1e3:.1f} ms/step, deterministic {r['deterministic_step_s'] * 1e3:.1f} ms/step ({r['deterministic_vs_default']:.2f}x)"
    return (
        f"{r['params'] / 1e6:.1f}M params, {r['checkpoint_bytes'] / 1e9:.3f} GB: ours sync {r['ours_sync']['save_s']:.2f} s "
        f"(DCP {r['dcp_save_s']:.2f} s, {r['ours_sync_save_vs_dcp_save']:.2f}x), async stall {r['ours_async']['stall_s']:.3f} s "
        f"(DCP {r['dcp_async_stall_s']:.3f} s, {r['ours_async_stall_vs_dcp_async_stall']:.2f}x), load {r['ours_load_s']:.2f} s "
        f"(DCP {r['dcp_load_s']:.2f} s, {r['ours_load_vs_dcp_load']:.2f}x)"
    )


def write(out: str | None, results: dict) -> None:
    if out:
        os.makedirs(out, exist_ok=True)
        Path(out, "gpu_check.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())

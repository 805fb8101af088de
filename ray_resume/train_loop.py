"""The built-in job's training function: restore, loop, maybe save.

It is a train_func like any user's (`ray_resume.fit` runs it, with the
RankCheckpointer every rank gets from `get_checkpointer()`). After a worker
loss Ray restarts the whole group and this function runs again from the top;
what it resumes comes from the job's controller on the driver, which
remembers what this job has committed, so a restart continues from the
newest committed iteration even when the first start had no `load_path`.
"""

from __future__ import annotations

import logging
import math
import time

import ray.train
import ray.train.torch
import torch
import torch.distributed as dist

from . import parallel
from .calls import STOP_NOW
from .checkpoint.format.state import capture_rng, restore_rng, seed_everything, unwrap
from .data import DEFAULT_COLUMNS, SAMPLE_ID, ReadUnit, SampleStream, quiet_ray_data, read_eval_set
from .errors import ConfigError
from .optim import MainParamsOptimizer
from .plugins import expected_tokens, make_model
from .progress import Progress
from .rank import get_checkpointer

logger = logging.getLogger(__name__)


def train_func(config: dict) -> None:
    """The built-in job's train_func, as `ray_resume.fit` runs any: Ray's device and data reader around `train_worker`."""
    if not config.get("verbose"):
        quiet_ray_data()
    train_worker(
        get_checkpointer(),
        ray.train.torch.get_device(),  # cuda:N with use_gpu (NCCL), else cpu (gloo)
        config["plugins"],
        stream=SampleStream,
        preempted=preemption_notice,
        units=[ReadUnit(*u) for u in config["units"]],
    )


def preemption_notice() -> bool:
    """Whether Ray Train announced this rank's node will be preempted: `ray.train.get_preemption_info`,
    public from Ray 2.58; an older Ray gives none, and a preempted node is then a lost worker."""
    notice = getattr(ray.train, "get_preemption_info", None)
    return notice is not None and notice() is not None


def train_worker(ck, device, plugins, *, stream=SampleStream, preempted=lambda: False, units=None) -> None:
    """Restore, loop, maybe save: one rank's run of the built-in job, through its RankCheckpointer `ck`.

    `stream` makes the data stream (SampleStream's signature), `preempted()`
    says whether the platform announced a preemption, `units` are the dataset's
    row groups as the driver listed them (None: this rank lists data.path).
    """
    if not logging.getLogger().handlers:  # outside Ray Train (which configures the root logger)
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)  # deterministic and fair on small CPU hosts
    job = ck.job
    cfg, controller, rank, world, attempt = job.cfg, job.controller, job.rank, job.world, job.attempt
    train = cfg.training
    began = time.monotonic()

    seed_everything(train.seed)  # identical initial weights on every rank
    model = parallel.wrap(make_model(plugins, cfg).to(device), train.strategy, cfg.model.fsdp_units, device, world)
    model.train()  # a builder may hand over a model in eval mode (from_pretrained does): dropout would be off
    optimizer = MainParamsOptimizer(
        model,
        lr=train.lr,
        weight_decay=train.weight_decay,
        optimizer_class=plugins.optimizer,
        optimizer_args=train.optimizer_args,
        grad_clip=train.grad_clip,
    )
    seed_everything(train.seed + rank)  # distinct dropout streams per rank

    resume = ck.restore(model, optimizer, global_batch_size=train.global_batch_size)
    tokens = expected_tokens(plugins, cfg)
    samples = stream(
        units or cfg.data.path,
        cfg.data.seed,
        cfg.data.shuffle,
        train.global_batch_size,
        rank,
        world,
        resume.consumed_samples,
        columns=cfg.data.columns or None,
        lanes=cfg.data.lanes,
        storage=cfg.checkpoint.storage,
        pack=cfg.pack_tokens(),
        data_map=plugins.data_map,
        vocab_size=tokens.vocab_size if tokens else None,
        read_tasks_above=cfg.data.read_tasks_above,
    )
    progress = Progress(cfg, rank, attempt, job.job_id, controller)
    progress.resumed(resume, world, attempt, **job.ended, restore_s=time.monotonic() - began)

    evaluate = Evaluator(cfg, plugins, rank, world, device) if train.eval_every else None
    batches = iter(samples)
    accumulation = train.accumulation_steps(world)
    noticed = False  # a preemption notice was seen and saved for
    stop_poll = controller.should_stop_polled() if rank == 0 else None
    stop = 0  # the controller's last should_stop answer (calls.SAVE_AND_STOP, STOP_NOW)
    for step in range(resume.step + 1, train.train_steps + 1):
        lr = learning_rate(train, samples.position)  # of the samples consumed before this step
        waited = time.monotonic()
        batch = next(batches)
        if step == resume.step + 1:
            progress.first_batch(time.monotonic() - waited)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss = train_step(model, optimizer, plugins, batch, train.micro_batch_size, accumulation, device)
        job.faults.maybe_kill("after_optimizer_step", step)
        consumed = samples.position
        stop, notice = 0, False
        if step < train.train_steps:
            looks = step % train.log_every == 0 and not noticed  # for a preemption notice (a save if one came)
            notice = looks and preempted()
            if stop_poll is not None:
                stop = should_stop(stop_poll, may_save=looks or ck.saves_at(step))
        loss, stop, notice = _agree_after_step(loss, stop, notice, world)
        noticed = noticed or notice
        if stop == STOP_NOW:  # the writer lease is lost: no more saves; the driver ends the run with it
            break
        saved = ck.maybe_save(
            step,
            consumed_samples=consumed,
            global_batch_size=train.global_batch_size,
            force=bool(stop) or notice or step == train.train_steps,
            common={
                "epoch_num": consumed // samples.epoch_size,
                "step_num": (consumed % samples.epoch_size) // train.global_batch_size,
                "data": samples.fingerprint,
            },
        )
        # A memory snapshot flushes the metrics too: a resume from it redoes no step to record again.
        snapshot = ck.last_snapshot_step == step
        progress.step(
            step,
            loss,
            optimizer.param_groups[0]["lr"],
            optimizer.grad_norm,
            batch["sample_id"],
            saved,
            ck.last_stall_s if saved else None,
            flush=snapshot,
            data_bytes=samples.bytes_read,
        )
        if saved and (why := ck.async_chosen_at(step)):
            progress.async_save_chosen(step, why)
        if evaluate and (step % train.eval_every == 0 or step == train.train_steps):
            progress.evaluated(step, *evaluate(model))
        if rank == 0:
            controller.stepped(attempt, step)
        if stop:
            progress.stopped(step)
            break
    # The last (async) save must be written and reported before this worker returns; raises its error.
    final_wait = ck.finish(save_last=stop != STOP_NOW)
    if ck.last_stall_s is not None:
        progress._record({"event": "save_wait", "step": train.train_steps, "save_stall_s": final_wait}, flush=True)
    if rank == 0:
        controller.record_final_metrics(progress.last)


def learning_rate(train, consumed: int) -> float:
    """The LR of the step that follows `consumed` samples: a pure function of them, so it needs no
    checkpoint, and a resume with another global_batch_size continues the curve where it was, as
    long as train_steps and warmup_steps are scaled with it (they are counted in its samples).

    Warmup rises linearly over the first `warmup_steps x global_batch_size` samples (from 0, as
    Megatron's does); then `lr_decay_style` takes the LR from `lr` to `min_lr` by `train_steps x
    global_batch_size` samples: constant, linear, cosine, or wsd (stable, then linear over the last
    `wsd_decay_fraction` of the samples after warmup).
    """
    warmup, total = train.warmup_steps * train.global_batch_size, train.train_steps * train.global_batch_size
    if consumed < warmup:
        return train.lr * consumed / warmup
    progress = min(1.0, (consumed - warmup) / max(1, total - warmup))
    style = train.lr_decay_style
    if style == "constant":
        return train.lr
    if style == "linear":
        decay = 1.0 - progress
    elif style == "cosine":
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:  # wsd
        decay = min(1.0, (1.0 - progress) / train.wsd_decay_fraction)
    return train.min_lr + (train.lr - train.min_lr) * decay


def scalar_loss(loss):
    """The loss plugin's result, if it is what backward needs: a floating-point tensor of one element."""
    if not (torch.is_tensor(loss) and loss.numel() == 1 and loss.is_floating_point()):
        got = (
            f"a {loss.dtype} tensor of shape {list(loss.shape)}"
            if torch.is_tensor(loss)
            else f"a {type(loss).__name__}"
        )
        raise ConfigError(
            f"training.loss returned {got}; it must return a scalar floating-point tensor "
            "(reduce it over the batch, with .mean() say)"
        )
    return loss


def train_step(model, optimizer, plugins, batch: dict, micro_batch: int, accumulation: int, device) -> torch.Tensor:
    """One optimizer step over this rank's share of the global batch; returns this rank's loss (a
    mean over its micro-batches), which `_agree_after_step` sums over the ranks."""
    columns = {k: v for k, v in batch.items() if k != "sample_id"}
    optimizer.zero_grad()
    total = torch.zeros((), device=device)
    for i in range(accumulation):
        # Only the last micro-batch reduces gradients across ranks; the others accumulate locally.
        with parallel.gradient_sync(model, i == accumulation - 1):
            micro = plugins.collate({k: v[i * micro_batch : (i + 1) * micro_batch] for k, v in columns.items()})
            micro = {k: t.to(device, non_blocking=True) for k, t in micro.items()}
            loss = scalar_loss(plugins.loss(model, micro)) / accumulation
            optimizer.backward(loss)
        total += loss.detach().float()
    optimizer.step()
    return total


def should_stop(poll, may_save: bool) -> int:
    """Rank 0's `should_stop` answer for this step, from `poll` (calls.Polled). A step that may save
    (or stop, saving) waits for a fresh answer: no save may write into a root whose lease was lost.
    Any other takes the newest answer in, without a round trip to the driver."""
    stop = poll.latest()
    return poll.now() if stop or may_save else stop


def _agree_after_step(loss: torch.Tensor, stop: int, notice: bool, world: int) -> tuple[float, int, bool]:
    """(the global mean loss, the controller's `should_stop` answer, save now and go on), the same on
    every rank, in one collective: a sum, to which only rank 0 brings the answer and every rank
    its own loss and notice.

    SAVE_AND_STOP: the driver got SIGTERM, or a commit failed. STOP_NOW: the
    lease is lost. Save and go on: `preempted()` (Ray Train's notice that a
    node will be preempted; asked every log_every steps, ~7 ms) is true on
    some rank. As Ray Train documents, the run keeps training on
    the node's remaining time: the commit bounds what its loss costs, and
    the group restarts from it when the node is gone.
    """
    total = torch.cat([loss.float().reshape(1), torch.tensor([stop, notice], dtype=torch.float32, device=loss.device)])
    dist.all_reduce(total)
    summed, stop, notices = total.tolist()
    return summed / world, int(stop), notices > 0


class Evaluator:
    """The mean loss over the held-out `data.eval_path`, every rank a contiguous equal share of it.

    In eval mode, without gradients, on the unwrapped module (no DDP collectives; FSDP2 gathers,
    which is why every rank runs the same number of micro-batches), and with every RNG (torch,
    CUDA, numpy, python: a collate or loss may draw from any) put back afterwards: the training
    streams continue as if no evaluation had run, so exact resume still holds.
    """

    def __init__(self, cfg, plugins, rank: int, world: int, device):
        self.plugins, self.device, self.micro = plugins, device, cfg.training.micro_batch_size
        columns = dict(cfg.data.columns or DEFAULT_COLUMNS)
        data = read_eval_set(cfg.data.eval_path, columns, cfg.checkpoint.storage, cfg.pack_tokens(), plugins.data_map)
        share = len(data[SAMPLE_ID]) // world // self.micro * self.micro
        self.columns = {name: data[name][rank * share : (rank + 1) * share] for name in columns}
        self.samples = share * world

    def __call__(self, model) -> tuple[float, int]:
        """(mean loss, samples evaluated), the same on every rank."""
        module = unwrap(model)
        total = torch.zeros(2, dtype=torch.float64, device=self.device)  # loss sum, samples
        rng = capture_rng()
        module.eval()
        try:
            with torch.no_grad():
                for lo in range(0, len(next(iter(self.columns.values()))), self.micro):
                    micro = self.plugins.collate({k: v[lo : lo + self.micro] for k, v in self.columns.items()})
                    micro = {k: t.to(self.device, non_blocking=True) for k, t in micro.items()}
                    total += torch.stack(
                        [
                            self.plugins.loss(module, micro).double() * self.micro,
                            torch.tensor(self.micro, dtype=torch.float64, device=self.device),
                        ]
                    )
        finally:
            module.train()
            restore_rng(rng)
        dist.all_reduce(total)
        return float(total[0] / total[1]), self.samples

"""Loss per step over every attempt of a run, with saves and resumes marked.

Reads the records every rank writes beside the checkpoint root
(`metrics_dir(save_path)` = `ROOT-metrics/`, see `ray_resume.metrics`):

    {"job", "attempt", "rank", "event": "start", "step", "source", "world_size"}   each worker-group start
    {"job", "attempt", "rank", "step", "loss", "sample_ids", "saved"}               each step
    {"job", "attempt", "rank", "event": "eval", "step", "eval_loss", "samples"}    each evaluation (rank 0)

One line per (job, attempt), so the steps repeated after a resume show up
as a second line over the first; dashed verticals where a checkpoint was
saved; solid verticals where an attempt resumed, labelled with the
iteration it loaded. matplotlib is imported lazily (Agg canvas, no
display) and is an optional dependency: `pip install 'ray_resume[plot]'`.
"""

from __future__ import annotations

import posixpath

from .errors import CliError
from .metrics import metrics_dir, read_metrics


def read_records(root: str, storage_options=None) -> dict[int, list[dict]]:
    """Every metrics record of the run saving to `root`, by rank, oldest first."""
    records = read_metrics(root, storage_options)
    if not records:
        raise CliError(f"{metrics_dir(root)}: no metrics records (is {root!r} the job's checkpoint.save_path?)", 2)
    out: dict[int, list[dict]] = {}
    for r in records:
        out.setdefault(int(r.get("rank", 0)), []).append(r)
    return out


def summarize(records_by_rank: dict[int, list[dict]]) -> dict:
    """Runs (one per (job, attempt)), save steps and resume points from the lowest rank's records."""
    rank = min(records_by_rank)
    runs: dict[tuple, dict[int, float]] = {}
    saves: set[int] = set()
    starts: list[dict] = []
    evals: dict[int, float] = {}  # step -> eval loss (a redone evaluation gives the same value)
    for r in records_by_rank[rank]:
        key = (r.get("job"), r.get("attempt"))
        if r.get("event") == "start":
            runs.setdefault(key, {})
            starts.append(r)
        elif r.get("event") == "eval":
            evals[r["step"]] = r["eval_loss"]
        elif "loss" in r and "step" in r:
            runs.setdefault(key, {})[r["step"]] = r["loss"]
            if r.get("saved"):
                saves.add(r["step"])
    resumes = [
        {
            "job": s.get("job"),
            "attempt": s.get("attempt"),
            "step": s["step"],
            "source": s["source"],
            "world_size": s.get("world_size"),
        }
        for s in starts
        if s.get("source")
    ]
    # A start with nothing to load after the first one: a restart from scratch.
    restarts = [
        {"job": s.get("job"), "attempt": s.get("attempt"), "step": s["step"]} for s in starts[1:] if not s.get("source")
    ]
    return {
        "rank": rank,
        "runs": runs,
        "saves": sorted(saves),
        "resumes": resumes,
        "restarts": restarts,
        "evals": dict(sorted(evals.items())),
    }


def _import_matplotlib():
    try:
        import matplotlib  # noqa: F401
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise CliError("matplotlib is not installed; plotting needs it: pip install 'ray_resume[plot]'") from None
    return Figure, FigureCanvasAgg


def plot_run(
    root: str, output: str, *, storage_options=None, width: float = 11.0, height: float = 5.5, dpi: int = 100
) -> dict:
    """Write the loss plot of the run saving to `root` to `output` (PNG); return what was drawn."""
    Figure, FigureCanvasAgg = _import_matplotlib()
    info = summarize(read_records(root, storage_options))
    runs = {k: v for k, v in info["runs"].items() if v}
    if not runs:
        raise CliError(f"{metrics_dir(root)}: no per-step loss records yet", 2)

    # The object API with an explicit Agg canvas: no pyplot, no global backend switch.
    fig = Figure(figsize=(width, height), dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    jobs = list(dict.fromkeys(job for job, _ in runs))
    for n, ((job, attempt), losses) in enumerate(runs.items()):
        steps = sorted(losses)
        label = f"attempt {attempt}" if len(jobs) == 1 else f"job {str(job)[:8]} attempt {attempt}"
        # Later attempts are drawn thinner and on top, so the replayed steps
        # after a resume show whether they repeat the first run exactly.
        ax.plot(
            steps,
            [losses[s] for s in steps],
            marker="o",
            markersize=3,
            linewidth=2.2 - min(n, 3) * 0.5,
            label=label,
            zorder=2 + n,
        )
    if info["evals"]:
        ax.plot(
            list(info["evals"]),
            list(info["evals"].values()),
            color="black",
            marker="s",
            markersize=5,
            linestyle="--",
            linewidth=1.2,
            label="eval loss (held-out)",
            zorder=20,
        )
    for i, step in enumerate(info["saves"]):
        ax.axvline(
            step, color="0.55", linestyle="--", linewidth=0.9, zorder=1, label="checkpoint saved" if i == 0 else None
        )
    top = ax.get_ylim()[1]
    for i, r in enumerate(info["resumes"]):
        ax.axvline(
            r["step"], color="tab:red", linestyle="-", linewidth=1.4, zorder=1, label="resumed from" if i == 0 else None
        )
        ax.annotate(
            f"resume: {posixpath.basename(str(r['source']).rstrip('/'))} (attempt {r['attempt']})",
            xy=(r["step"], top),
            xytext=(3, -4),
            textcoords="offset points",
            rotation=90,
            va="top",
            ha="left",
            fontsize=8,
            color="tab:red",
            bbox={"boxstyle": "round,pad=0.2", "facecolor": "white", "edgecolor": "none", "alpha": 0.85},
            zorder=10,
        )
    for i, r in enumerate(info["restarts"]):
        ax.axvline(
            r["step"],
            color="tab:orange",
            linestyle=":",
            linewidth=1.4,
            zorder=1,
            label="restart with no checkpoint" if i == 0 else None,
        )
    ax.set_xlabel("global step")
    ax.set_ylabel(f"loss (rank {info['rank']})")
    ax.set_title(f"loss per step, every attempt: {root}", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(output, format="png")
    return {
        "output": output,
        "runs": len(runs),
        "saves": info["saves"],
        "resumes": info["resumes"],
        "restarts": info["restarts"],
        "evals": info["evals"],
    }

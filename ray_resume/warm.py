"""Standby processes for a restarted worker group, its imports already done.

Ray Train replaces the whole worker group after a failure: new actors, and for each a new
process that imports Ray Train, torch and ray_resume again before its first step (the restart
floor, ~5 s here, more where many processes import at once). Ray's raylet gives a new actor an
idle worker process when that process was started for the same job and runtime env and never
ran anything. So every group keeps such processes ready for the next one:

- the ranks' runtime env names `import_rank_modules` as Ray's worker process setup hook
  (`rank_runtime_env`), which every process started with it runs before it takes work;
- local rank 0 of each node asks its node's raylet to start processes, up to one waiting per
  rank on the node, with exactly the ranks' runtime env (`keep_standby`: Ray core's PrestartWorkers call, which
  Ray's Python API does not expose; the keep-alive keeps Ray from ending them as idle). They
  import while they wait, on idle CPU, and the next group's actors land in them.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from ray._private.ray_constants import WORKER_PROCESS_SETUP_HOOK_ENV_VAR as SETUP_HOOK

logger = logging.getLogger("ray_resume")

HOOK = f"{__name__}.import_rank_modules"  # the setup hook's value in the ranks' runtime env

KEEP_ALIVE_S = 7 * 24 * 3600  # a standby process waits as long as the job runs (Ray ends the job's processes with it)


def rank_runtime_env(runtime_env: dict) -> dict:
    """Ray Train's `worker_runtime_env` with our setup hook beside the user's env vars (a hook
    of the user's own is kept: the standby processes then run theirs)."""
    env_vars = dict(runtime_env.get("env_vars") or {})
    env_vars.setdefault(SETUP_HOOK, HOOK)
    return {**runtime_env, "env_vars": env_vars}


def import_rank_modules() -> None:
    """Ray's worker process setup hook for the ranks' processes: import what a rank imports before
    its first step (in a standby process, while it waits): all but ray_resume's own modules
    (0.15 s of the 5 s here), which import this one. The imports run on a thread of idle CPU
    priority (SCHED_IDLE is a thread's own: the process keeps its policy), so a standby process
    takes only what the training leaves; where the ranks use every core it may still be importing
    at the next failure, and that group starts in new processes, as without it."""
    thread = threading.Thread(target=_import_idle, name="ray_resume-imports")
    thread.start()
    thread.join()


def _import_idle() -> None:
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux: at normal priority
        pass
    import torch._dynamo  # noqa: F401  (DDP's constructor imports it)
    import ray.train.torch  # noqa: F401
    from ray.train.v2._internal.execution.worker_group import worker  # noqa: F401  (Ray Train's worker actor)


def wanted(setting: bool | str, use_gpu: bool) -> bool:
    """Whether the ranks keep standby processes: `failure.standby_processes`, where "auto" means
    when they train on GPUs. A standby process's imports cost CPU once per group start (~5 s of a
    core here), which the steps of ranks on GPUs leave free; ranks that train on the CPU use its
    cores, the imports come out of their steps, and a restart gains no more than they cost
    (measured: docs/restarts.md). Where it is not wanted, no rank process runs the setup hook either:
    an import at idle priority in a rank's own process would wait for every busy core."""
    return setting is True or (setting == "auto" and use_gpu)


def waiting_here(job_id: str) -> int:
    """This node's standby processes of job `job_id`: started with the ranks' setup hook (and the job
    id the raylet gives a worker's environment), holding no actor yet, idle (`ray::IDLE`) or still
    importing (not yet titled by Ray). 0 where there is no /proc."""
    hook, job = f"{SETUP_HOOK}={HOOK}".encode(), f"RAY_JOB_ID={job_id}".encode()
    waiting = 0
    try:
        entries = [e for e in Path("/proc").iterdir() if e.name.isdigit()]
    except OSError:
        return 0
    for entry in entries:
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
            title = (entry / "cmdline").read_bytes().split(b"\0")[0]
        except OSError:  # gone, or another user's
            continue
        if hook in env and job in env and (title == b"ray::IDLE" or not title.startswith(b"ray::")):
            waiting += 1
    return waiting


def keep_standby(processes: int) -> threading.Thread:
    """In the background: ask this node's raylet for idle worker processes with this rank's job and
    runtime env, for the next worker group, up to `processes` waiting (one that was still importing
    when this group started in new processes waits for the next failure). A refusal costs a slower
    restart, never the run: it is logged."""
    thread = threading.Thread(target=_prestart, args=(processes,), name="ray_resume-standby", daemon=True)
    thread.start()
    return thread


def _prestart(processes: int) -> None:
    import ray
    from ray._private.grpc_utils import init_grpc_channel
    from ray._private.utils import get_runtime_env_info
    from ray.core.generated import common_pb2, node_manager_pb2, node_manager_pb2_grpc
    from ray.runtime_env import RuntimeEnv

    try:
        context = ray.get_runtime_context()
        processes -= waiting_here(context.get_job_id())
        if processes <= 0:
            return
        node = next(n for n in ray.nodes() if n["NodeID"] == context.get_node_id())
        # The string this process was started with, byte for byte: the raylet matches processes
        # to actors by its hash, and Ray merged the job's runtime env into it.
        serialized = context.get_runtime_env_string()
        info = get_runtime_env_info(RuntimeEnv.deserialize(serialized))
        info.serialized_runtime_env = serialized
        request = node_manager_pb2.PrestartWorkersRequest(
            language=common_pb2.PYTHON, job_id=bytes.fromhex(context.get_job_id()), runtime_env_info=info,
            keep_alive_duration_secs=KEEP_ALIVE_S, num_workers=processes)
        with init_grpc_channel(f"{node['NodeManagerAddress']}:{node['NodeManagerPort']}") as channel:
            node_manager_pb2_grpc.NodeManagerServiceStub(channel).PrestartWorkers(request, timeout=30)
    except Exception as exc:  # noqa: BLE001  (a slower restart, not a failed run)
        logger.warning("standby processes for a restart were not started (%s: %s); a restart starts new ones",
                       type(exc).__name__, exc)

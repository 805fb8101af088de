"""What makes a fork of the fork server (ray_resume.forkserver) the process Ray would have started
(invariant 15): the server's imports, made so that it can fork safely (no thread, no CUDA, no Ray
IDs its forks would share), and in each fork what a fresh `python default_worker.py` has and a
fork would have taken from the server instead, set anew. scripts/fork_parity.py compares the two
on a real `fit()`."""

from __future__ import annotations

import importlib
import os
import runpy
import signal
import sys
import time
from collections.abc import Sequence

# While the server imports: libraries that would start threads at load start none (OpenBLAS's pool,
# jemalloc's purger in pyarrow), so that it can fork; a fork sizes its pools from its own environment.
NO_THREADS_AT_LOAD = {"OPENBLAS_NUM_THREADS": "1", "JE_ARROW_MALLOC_CONF": "background_thread:false"}

_fork = False  # set in a fork of the server


def is_fork() -> bool:
    """Whether this process is a fork of the fork server."""
    return _fork


def run_worker(request: dict, signals: dict) -> None:
    """In the child: become the process Ray started and run Ray's worker as `python
    default_worker.py ...` would: its environment, directory, arguments, the signal dispositions
    a fresh interpreter has (`signals`, as the server started), its own random state, a process
    group of its own (Ray ends a worker's group after it), the end of an interpreter (exit code,
    `atexit`)."""
    global _fork
    _fork = True
    os.setsid()
    for sig, handler in signals.items():
        if signal.getsignal(sig) != handler:
            signal.signal(sig, handler)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = list(request["argv"])
    sys.orig_argv = [sys.executable, *sys.argv]
    _reseed()
    runpy.run_path(sys.argv[0], run_name="__main__")


def _reseed() -> None:
    """Draw anew what a fresh interpreter draws from the OS at start and forks would share: numpy's
    global generator and torch's default one (`random` CPython reseeds in a fork itself). Not the
    hash seed of str and bytes, drawn once per interpreter (docs/restarts.md)."""
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "torch" in sys.modules:
        sys.modules["torch"].default_generator.seed()


def size_thread_pools() -> None:
    """In a fork, once Ray has set the rank's thread count (`OMP_NUM_THREADS`, when it creates the
    actor: after the fork): torch's and the native thread pools sized as a fresh process sizes them
    when it loads them, from that environment (a fork's were sized in the server's)."""
    if not _fork:
        return
    import torch
    from threadpoolctl import threadpool_limits

    def first(*names: str) -> int | None:
        values = (os.environ.get(name, "").split(",")[0].strip() for name in names)
        return next((int(v) for v in values if v.isdigit() and int(v) > 0), None)

    omp = first("OMP_NUM_THREADS")
    limits = {
        "openmp": omp,
        "mkl": first("MKL_NUM_THREADS", "OMP_NUM_THREADS"),
        "blis": first("BLIS_NUM_THREADS", "OMP_NUM_THREADS"),
        # loaded in the server with one (NO_THREADS_AT_LOAD): its default is every CPU
        "openblas": first("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS")
        or len(os.sched_getaffinity(0)),
    }
    threadpool_limits(limits={api: n for api, n in limits.items() if n})
    if omp:
        torch.set_num_threads(omp)


def cannot_fork() -> str | None:
    """Why this process must not fork now (None: it may). CUDA initialised (a child cannot use a
    context its parent made), or a thread other than this one, a native one too: it may hold a lock
    a child would wait on forever, and the CUDA driver starts one when a device query initialises it
    without torch's CUDA (on an H200 after `torch.cuda.device_count()`: scripts/gpu_check.py). A mapped
    libcuda is no sign: a CUDA build of torch maps it as it loads, and its forks use the GPU."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA is initialised in the server"
    for _ in range(20):  # a thread just joined leaves /proc/self/task a moment later
        threads = len(os.listdir("/proc/self/task")) - 1
        if not threads:
            break
        time.sleep(0.05)
    else:
        return f"native threads in the server ({threads} besides its own)"
    return None


def import_rank_modules(preload: Sequence[str]) -> None:
    """What a rank imports before its first step: torch, `torch._dynamo` (DDP's constructor imports
    it), Ray, Ray Train (its worker actor's module, `ray.train.torch`) and `preload`, with no
    library starting a thread as it loads (NO_THREADS_AT_LOAD). Module-level `@ray.remote` classes
    in Ray Train and Ray Data draw an `ActorClassID` at import, and the first draw seeds Ray's ID
    generator, whose state forks share: every fork after it drew the same IDs (two ranks died in
    Ray's object store warm-up, "Seal() called on an object without a reference to it"). Those class
    IDs come from the OS here instead (they are a class's label, never looked up);
    `forks_draw_distinct_ids` checks that no other draw was made."""
    saved = {name: os.environ.get(name) for name in NO_THREADS_AT_LOAD}
    os.environ.update(NO_THREADS_AT_LOAD)
    try:
        import torch._dynamo  # noqa: F401
        import ray.actor
        from ray._raylet import ActorClassID

        class FromTheOS:
            @staticmethod
            def from_random() -> ActorClassID:
                return ActorClassID(os.urandom(ActorClassID.size()))

        ray.actor.ActorClassID = FromTheOS
        try:
            import ray.train.torch  # noqa: F401
            import ray.train.v2._internal.execution.worker_group.worker  # noqa: F401  (Ray Train's worker actor)
            import ray.tune  # noqa: F401  (Ray Train's worker imports it when it sets up torch)

            for name in preload:
                importlib.import_module(name)
        finally:
            ray.actor.ActorClassID = ActorClassID
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def forks_draw_distinct_ids() -> bool:
    """Whether two forks of this process draw different random Ray IDs."""
    from ray._raylet import ObjectID

    drawn = []
    for _ in range(2):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.write(write, ObjectID.from_random().binary())
            os._exit(0)
        os.close(write)
        os.waitpid(pid, 0)
        drawn.append(os.read(read, 64))
        os.close(read)
    return drawn[0] != drawn[1]

"""The job's controller, on the driver's node: attempts, commits, retention, the memory tier's ledger."""

from .job import CommitError, JobController, restart_clock

__all__ = ["JobController", "CommitError", "restart_clock"]

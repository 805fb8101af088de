"""The job's controller, on the driver's node: attempts, commits, retention, the memory tier's ledger."""

from .job import JobController

__all__ = ["JobController"]

"""The job's controller, on the driver's node: attempts, commits, retention, the memory tier's ledger."""

from .job import CommitError, JobController

__all__ = ["JobController", "CommitError"]

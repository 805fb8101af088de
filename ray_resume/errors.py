"""Every error class of ray_resume. The mistakes a user can fix, one class each (`USER_ERRORS`): the
message says what is wrong, where, and what to do; raised on the driver before Ray starts wherever it
can be found there, never retried when a rank finds one (`rank.run_rank` reports it once), and raised
to the caller as the one of these three classes the rank's was. And `CommitError`, a failed commit.
"""

from __future__ import annotations

from collections.abc import Iterable


class ConfigError(ValueError):
    """All problems found in a config; ``.problems`` holds one line per problem."""

    def __init__(self, problems: str | Iterable[str]):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        if len(self.problems) == 1:
            msg = self.problems[0]
        else:
            msg = f"{len(self.problems)} config problems:\n" + "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(msg)


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as it is; the message says where and why."""


class DataError(ValueError):
    """A dataset that cannot be read as configured: a missing path, another schema, a bad row."""


USER_ERRORS = (ConfigError, CheckpointError, DataError)


class CommitError(RuntimeError):
    """A commit failed: the run ends with this error, and its tracker stays on the last good commit."""

"""Every error class of ray_resume. The mistakes a user can fix, one class each (`USER_ERRORS`): the
message says what is wrong, where, and what to do; raised on the driver before Ray starts wherever it
can be found there, never retried when a rank finds one (`rank.run_rank` reports it once), and raised
to the caller as the one of these three classes the rank's was. Then what the machinery raises and
catches (damage, a lost lease, a failed background save...), and a command's one-line failure.
`driver.TrainingFailed`, what `fit` raises, is Ray Train's `TrainingFailedError` and lives where Ray
is imported: this module is the checkpoint core's, which runs without Ray.
"""

from __future__ import annotations

import traceback
from collections.abc import Iterable
from dataclasses import dataclass


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


class DamagedShards(CheckpointError):
    """The bytes of a shard disagree with metadata.json (size, checksum, header): the loading
    ranks fall back to an older iteration, as the driver does for damaged metadata."""


class AbnormalIteration(CheckpointError):
    """common.json says `ckpt_status` 1 (abnormal): MindFormers passes such an iteration over for an
    older healthy one, and so do we; it is not damage, and is never set aside."""


class LeaseLost(RuntimeError):
    """This job no longer holds the save_path's lease: it must not commit."""


class AsyncSaveError(RuntimeError):
    """A checkpoint save that ran in the background failed; the cause is chained."""


class WriterDied(RuntimeError):
    """The writer process ended while a save was in flight; that save is lost, the next one starts a new writer."""


class CliError(Exception):
    """A command's failure (`ray-resume`), reported as one `error:` line; `code` is its exit status (2: usage)."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def user_error_classes() -> dict[str, type]:
    """The classes of USER_ERRORS and their subclasses here, by name: what a RankError may name."""
    return {k.__name__: k for k in globals().values() if isinstance(k, type) and issubclass(k, USER_ERRORS)}


@dataclass(frozen=True)
class RankError:
    """A mistake of the user's that a rank found, as it crosses to the job's controller and from it to the
    driver: the name of its class (one of this module's: a user's own subclass travels as the nearest of
    them), its message, ConfigError's problems, and the rank's traceback text."""

    rank: int
    kind: str
    message: str
    problems: tuple[str, ...] = ()
    traceback: str = ""

    def __post_init__(self):
        if self.kind not in user_error_classes():
            raise TypeError(f"a rank's error of kind {self.kind!r}, which is not one of ray_resume.errors' user errors")

    @classmethod
    def of(cls, rank: int, exc: BaseException) -> "RankError":
        classes = user_error_classes()
        kind = next(k.__name__ for k in type(exc).__mro__ if classes.get(k.__name__) is k)
        problems = tuple(exc.problems) if isinstance(exc, ConfigError) else ()
        return cls(rank, kind, str(exc), problems, "".join(traceback.format_exception(exc)))

    def error(self) -> Exception:
        """The exception of its class, with its problems, its message naming the rank, the rank's traceback
        as a note (shown under the message when it is not caught)."""
        kind = user_error_classes()[self.kind]
        exc = kind(list(self.problems) or self.message) if issubclass(kind, ConfigError) else kind(self.message)
        exc.args = (f"rank {self.rank}: {exc}",)
        exc.add_note(f"rank {self.rank}'s traceback:\n{self.traceback.rstrip()}")
        return exc

"""Project exceptions. Each cause has its own exit code, which travels unchanged to the shell."""

from __future__ import annotations


class TrainError(Exception):
    """Base of every error a user can act on; ``str(error)`` says what is wrong and how to fix it."""

    exit_code = 1


class ConfigError(TrainError):
    """Bad command line, config file, key, type or value."""

    exit_code = 2


class DataError(TrainError):
    """Missing, unreadable or malformed data, or a cache that cannot be built."""

    exit_code = 3


class PreflightError(TrainError):
    """The environment cannot run this launch (devices, /dev/shm, ports, disk)."""

    exit_code = 4


class DiskFullError(PreflightError):
    """A write failed because its file system is full (or over quota); built by ``train.disk``, wherever the
    write was, after its partial file was removed: nothing is lost, free space and re-run."""

    def __init__(self, message: str, path=None, free: int | None = None, needed: int | None = None):
        super().__init__(message)
        self.path, self.free, self.needed = path, free, needed


class DistributedError(TrainError):
    """A rank failed, timed out or disagreed with the others."""

    exit_code = 5


class Preempted(TrainError):
    """Stopped on request (SIGTERM/SIGUSR1) with a checkpoint saved; re-run the same command to resume."""

    exit_code = 75


class StopRequested(BaseException):
    """SIGTERM or SIGUSR1 reached the launcher before or between launches of the ranks (doctor, data, cache,
    waiting for other nodes). Raised wherever the launcher was, so every stage unwinds its temporary files;
    nothing is lost and a re-run continues, so the exit code is Preempted's. A BaseException: no
    ``except Exception`` on the way may swallow it."""

    exit_code = 75
    pending: str | None = None
    """The message of the stop a signal requested, kept as well as raised: an exception raised while Python runs
    a finalizer (an h5py or numpy object freed mid-write) is only printed, and the stop would be lost."""

    @classmethod
    def check(cls) -> None:
        """Raise the requested stop again, for loops and stage boundaries: a no-op unless a signal asked."""
        if cls.pending is not None:
            raise cls(cls.pending)


class StoreUnavailable(Preempted):
    """The store a run streams its shards from stopped answering for longer than data.store_wait_s: the ranks
    stopped with a checkpoint, like a preemption; re-run the same command once the store answers again."""

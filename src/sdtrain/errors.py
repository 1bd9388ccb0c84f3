"""Errors that the user can fix: printed as one paragraph, never as a traceback wall."""


class SdtrainError(Exception):
    """A problem with the user's input (config, data, cluster): the message says what and how to fix it."""

    def __init__(self, *args: object):
        super().__init__(*args)
        # Kept apart from args: Ray Data appends its retry advice to the args of an error a read task raised ("Failed
        # to apply UDF transform after 1/1 attempts ... if you believe this to be transient"), which would follow our
        # message into the driver's. Pickling keeps it (an exception's __dict__ travels with it).
        self._message = super().__str__()

    def __str__(self) -> str:
        return getattr(self, "_message", None) or super().__str__()


class ConfigError(SdtrainError):
    """A config key is unknown, has the wrong type, or an impossible value."""


class DataError(SdtrainError):
    """A dataset file, column or row does not match what the model needs."""


class TrainingFailed(SdtrainError):
    """The run failed after Ray Train's retries; the message says where its last checkpoint is."""


class NonFiniteTraining(SdtrainError):
    """Too many consecutive optimizer steps had NaN/inf gradients: training has diverged."""


class StorageUnavailable(OSError):
    """Object storage failed for now, past its client's retries (throttling, a 5xx answer, a dropped or timed-out
    connection), or a shared filesystem did (a stale NFS handle, EIO): no SdtrainError, whose exit status 2 says "fix
    the input, do not retry" and which stops a Ray Train run without restarts, but an OSError as a failed read is. The
    message names the config key and the file; the command lines print it as one paragraph and exit EX_TEMPFAIL (75):
    running again may succeed."""


def find_sdtrain_error(error: BaseException) -> "SdtrainError | None":
    """Our own error inside ``error``, however Ray wrapped it (task errors, worker failures of a
    Ray Train run, a controller failure, exception chains); None if there is none."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [error]  # causes and contexts may be None
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        cause = getattr(current, "cause", None)  # RayTaskError: the exception the task raised
        if isinstance(current, SdtrainError) and not isinstance(cause, BaseException):
            return current
        pending.extend([cause, current.__cause__, current.__context__, getattr(current, "controller_failure", None)])
        pending.extend((getattr(current, "worker_failures", None) or {}).values())
    return None

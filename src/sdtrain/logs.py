"""The one logger of sdtrain's processes: ``logging.getLogger("sdtrain")``, as ``log`` here.

The driver's processes (every command line: training, retraining, the check job, preprocessing, indexing, generating)
print its lines to standard output as ``<date> <time> <LEVEL> [sdtrain] <message>``: timestamps to read a run's log
by, levels to filter it by (``SDTRAIN_LOG_LEVEL=WARNING`` keeps warnings and errors only). Inside Ray's workers the
same logger's lines go through Ray's own log handling, to the worker's log and the driver's console.
"""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger("sdtrain")

FORMAT = "%(asctime)s %(levelname)s [sdtrain] %(message)s"
DATE_FORMAT = "%Y-%m-%d %H:%M:%S"
LEVEL_ENV = "SDTRAIN_LOG_LEVEL"
"""The environment variable naming the lowest level printed (DEBUG, INFO, WARNING, ERROR); INFO if unset."""


class _Stdout(logging.StreamHandler):
    """Writes to whatever ``sys.stdout`` is when a line is logged, so a caller that redirects it (a notebook, a
    test's capture) sees the lines."""

    def __init__(self) -> None:
        super().__init__(sys.stdout)

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ and setStream assign it: stdout is looked up instead
        pass


def configure_logging(propagate: bool = False) -> None:
    """Print the sdtrain logger's lines to standard output (once per process, however often called).

    Args:
        propagate: also hand them to the root logger's handlers (tests: pytest's capture of logs).
    """
    if not any(isinstance(handler, _Stdout) for handler in log.handlers):
        handler = _Stdout()
        handler.setFormatter(logging.Formatter(FORMAT, DATE_FORMAT))
        log.addHandler(handler)
    level = os.environ.get(LEVEL_ENV, "INFO").upper()
    log.setLevel(level if level in logging.getLevelNamesMapping() else logging.INFO)
    log.propagate = propagate

"""Deprecated calls of sdtrain's own code made errors: in this process (a context) and in a subprocess with every
process it starts, Ray's workers included (PYTHONWARNINGS)."""

from __future__ import annotations

import logging
import pkgutil
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import sdtrain

# Libraries that say "deprecated" through logging instead of a warning (Ray Data's ``concurrency``, 2.51).
_LOGGERS = ("ray", "ray.data")


class _Deprecations(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "deprecated" in record.getMessage().lower():
            self.messages.append(record.getMessage())


@contextmanager
def deprecations_are_errors() -> Iterator[None]:
    """A DeprecationWarning whose caller is a module of sdtrain raises; a deprecation notice logged by Ray meanwhile
    fails at the end. Entered after the libraries are imported: Ray and Lightning add filters of their own at import,
    in front of those already there."""
    handler = _Deprecations()
    for name in _LOGGERS:
        logging.getLogger(name).addHandler(handler)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", category=DeprecationWarning, module=r"sdtrain\.")
            yield
    finally:
        for name in _LOGGERS:
            logging.getLogger(name).removeHandler(handler)
    assert not handler.messages, handler.messages


def pythonwarnings() -> str:
    """PYTHONWARNINGS that makes a DeprecationWarning raised for a call in any sdtrain module an error. Its module
    field is an exact name (no pattern), so each module is named. Set, it also keeps Ray from adding its own filter
    for its deprecations (ray.util.annotations), which would come first."""
    names = [m.name for m in pkgutil.walk_packages(sdtrain.__path__, "sdtrain.")]
    return ",".join(f"error::DeprecationWarning:{name}" for name in names)

"""The sdtrain logger's messages, caught in the test's own process."""

import logging


class LogLines(logging.Handler):
    """The sdtrain logger's messages while it is attached (whatever the logger's propagation)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())

    def __enter__(self):
        logging.getLogger("sdtrain").addHandler(self)
        return self

    def __exit__(self, *_):
        logging.getLogger("sdtrain").removeHandler(self)

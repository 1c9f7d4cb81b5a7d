"""What a live server logs, for asserting that bad input leaves one-line messages, never a traceback or an error."""

from __future__ import annotations

import logging


class ServerLog(logging.Handler):
    """Every record the server's loggers (ours and uvicorn's) emit while installed. Install it after the server
    started: uvicorn configures its loggers (and ours) at start."""

    NAMES = ("bitnetlm", "uvicorn.error")

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)

    def __enter__(self):
        for name in self.NAMES:
            logging.getLogger(name).addHandler(self)
        return self

    def __exit__(self, *exc):
        for name in self.NAMES:
            logging.getLogger(name).removeHandler(self)

    def lines(self) -> list[str]:
        return [self.format(r) for r in self.records]

    def problems(self) -> list[str]:
        """Records with a traceback, or at level ERROR and above."""
        return [
            self.format(r)
            for r in self.records
            if r.exc_info or r.levelno >= logging.ERROR or "Traceback" in r.getMessage()
        ]

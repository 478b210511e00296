"""lane's log output: INFO by default (start-up facts users want to see), as vLLM
does; LANE_LOGGING_LEVEL changes the level, LANE_CONFIGURE_LOGGING=0 leaves
logging to the application."""
from __future__ import annotations

import logging
import os
import sys

_FORMAT = "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"


def configure_logging() -> None:
    if os.environ.get("LANE_CONFIGURE_LOGGING", "1") == "0":
        return
    root = logging.getLogger("lane")
    if root.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%m-%d %H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(os.environ.get("LANE_LOGGING_LEVEL", "INFO").upper())
    root.propagate = False


def configure_process_logging(process_name: str) -> None:
    """Prefix a child process's log lines with its name and pid, as vLLM does
    ("(EngineCore_DP0 pid=123) INFO ...")."""
    fmt = logging.Formatter(f"({process_name} pid={os.getpid()}) {_FORMAT}", datefmt="%m-%d %H:%M:%S")
    for handler in logging.getLogger("lane").handlers:
        handler.setFormatter(fmt)


def set_level(level: int | str) -> None:
    logging.getLogger("lane").setLevel(level)

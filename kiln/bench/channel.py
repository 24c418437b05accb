"""The reply channel every benchmark worker process answers its driver on.

Libraries print to stdout (llama.cpp, oneDNN verbose, progress bars), so a worker keeps a
private copy of fd 1 for its JSON-line replies and points fd 1 at stderr for the rest.
"""

from __future__ import annotations

import json
import os
import sys
from typing import IO, Any


def reply_channel() -> IO[str]:
    """A private copy of stdout for replies; fd 1 (library chatter) goes to stderr."""
    fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return os.fdopen(fd, "w", buffering=1)


def send(chan: IO[str], msg: dict[str, Any]) -> None:
    """One JSON reply line."""
    chan.write(json.dumps(msg) + "\n")
    chan.flush()

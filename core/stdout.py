"""Writing a command's result to stdout when the reader may have gone (`... | head`)."""

from __future__ import annotations

import os
import sys


def write_result(text: str) -> None:
    """Print `text` to stdout; if the reader closed the pipe, stop writing quietly (no traceback, and the
    interpreter's final flush does not raise again) and leave the exit status to the caller."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)

"""Writing a command's result to stdout when the reader may have gone (`... | head`) or the output cannot be
written (a full disk, `> /dev/full`)."""

from __future__ import annotations

import os
import sys

# The exit code of bad input, in both command-line tools (engine and planner); a stdout that cannot be written is
# answered with it too, as a --trace or --timeline path that cannot be: the output's place is bad input.
EXIT_BAD_INPUT = 2


def _silence_stdout() -> None:
    """Point stdout at the null device, so the interpreter's final flush does not raise again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def write_result(text: str) -> None:
    """Print `text` to stdout. If the reader closed the pipe, stop writing quietly (no traceback) and leave the
    exit status to the caller; if stdout cannot be written at all, say why on stderr and exit
    EXIT_BAD_INPUT."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        _silence_stdout()
    except OSError as e:
        _silence_stdout()
        print(f"error: cannot write the result to standard output: {e.strerror or e}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT) from None

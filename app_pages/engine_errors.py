"""Engine failures as one clear sentence for a page (and the details for an expander), never a traceback."""

from __future__ import annotations


def engine_error_message(exc: BaseException, what: str = "sweep",
                         hint: str = "try fewer sizes, fewer repeats or fewer ranks") -> tuple[str, str | None]:
    """(one clear sentence for st.error, details for an expander or None) for a failed `what` ("sweep",
    "run"); `hint` says what to try after a timeout."""
    from engine.config import ConfigError
    from engine.launch import RankFailed, RunStopped, RunTimedOut, WorkerError
    from ui.tables import count

    if isinstance(exc, ConfigError):
        return f"The {what} cannot run as asked: {exc}", None
    if isinstance(exc, RankFailed):
        lines = [line for line in exc.detail.strip().splitlines() if line.strip()]
        last = lines[-1].strip() if lines else "no message"
        return (f"Rank {exc.rank} failed: {last}. The workers were stopped; the next run starts fresh ones.",
                exc.detail)
    if isinstance(exc, RunTimedOut):
        ranks = ", ".join(map(str, exc.ranks))
        return (f"The {what} did not finish within {exc.timeout_s:g} s (ranks {ranks} were still running)."
                f" The workers were stopped; {hint}.",
                str(exc))
    if isinstance(exc, RunStopped):
        done = f", after {count(exc.steps_done, 'step')}" if what == "run" else ""
        return (f"Stopped, as asked{done}. The workers were stopped; the next run starts fresh ones.", None)
    if isinstance(exc, TimeoutError):  # the server's time limit (server.queue: a Task past max_run_s)
        return f"The {what} was stopped: {exc}; {hint}.", None
    if isinstance(exc, WorkerError):
        return f"The worker processes failed: {exc}", None
    return f"The {what} failed ({type(exc).__name__}): {exc}", None

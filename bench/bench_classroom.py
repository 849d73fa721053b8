"""A class pressing Run at once: N browser sessions (Chromium tabs, each its own Streamlit session) on one
ShardLab server, loopback only, each pressing the data-parallel lesson's default live run.

    .venv/bin/python bench/bench_classroom.py                      # 30 sessions, the server's defaults
    .venv/bin/python bench/bench_classroom.py --no-cache           # every run executes (no shared answers)
    .venv/bin/python bench/bench_classroom.py --sessions 5 --stop-midway   # stop the server with runs queued

It prints completed runs, the wait from pressing Run to the verified result (p50, p95, max), the longest
any session went without seeing its place in line or its result, the server's peak memory (its process
and every worker), and the worker processes left once the server has stopped. Measured, never pass/fail
(tests/server/test_load.py runs a short form and checks what must always hold).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# every live lesson's run button: "Run on this machine", "Run expert parallel on this machine", ...
RUN_BUTTON = "on this machine"
# Each student has a browser of their own: no tab here may be throttled as a background tab.
CHROMIUM_ARGS += ["--disable-background-timer-throttling", "--disable-renderer-backgrounding",
                  "--disable-backgrounding-occluded-windows"]
# Installed in every tab before Run is pressed: the tab itself notes (Date.now(), so that a busy tab
# or this script's polling delays no measurement) when the live panel first shows a place in line or
# progress, and when it shows the result. Only the panel's own elements are read (its progress bar and
# its messages), not the lesson's words.
WATCH = """(run) => {
  const panel = () => [...document.querySelectorAll('[data-testid="stProgress"], [data-testid="stAlert"]')]
      .map(e => e.innerText).join('\\n');
  const seen = ["Waiting in this server's run queue", "Running ", "Calibrating this machine"];
  const result = ["the single-process reference", "cannot start", "failed", "did not finish"];
  window.__seen = null; window.__done = null; window.__verified = null;
  const look = () => {
    const text = panel();
    if (window.__done === null && result.some(s => text.includes(s))) {
      window.__done = Date.now();
      window.__verified = text.includes("matches the single-process reference");
    }
    if (window.__seen === null && (window.__done !== null || seen.some(s => text.includes(s))))
      window.__seen = Date.now();
  };
  new MutationObserver(look).observe(document.body, {subtree: true, childList: true, characterData: true});
  const button = [...document.querySelectorAll('button')].find(b => b.innerText.includes(run));
  window.__pressed = Date.now();
  button.click();
  return window.__pressed;
}"""
STATE = "() => [window.__pressed, window.__seen, window.__done, window.__verified]"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(env: dict | None = None, start_timeout_s: float = 90):
    """A ShardLab server on a free loopback port: yields (url, process)."""
    port = _free_port()
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamlit", "run", "app.py", "--server.headless", "true",
         "--server.port", str(port), "--browser.gatherUsageStats", "false"],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            try:
                with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                raise RuntimeError(f"streamlit did not start:\n{log.read().decode(errors='replace')}")
            time.sleep(0.3)
        yield url, proc
    finally:
        stop(proc)


def stop(proc: subprocess.Popen, timeout_s: float = 20) -> tuple[float, bool]:
    """SIGTERM the server as a teacher's Ctrl-C would: (seconds it took to exit, whether it had to be
    killed after timeout_s)."""
    if proc.poll() is not None:
        return 0.0, False
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout_s)
        return time.monotonic() - start, False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return time.monotonic() - start, True


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid:
            out.append(int(entry.name))
    return out


def tree_rss_bytes(pid: int) -> int:
    """Resident memory of a process and all its descendants."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
        todo += _children(p)
    return total


def workers_of(server_pid: int) -> list[int]:
    """Live worker processes started by that server (engine.launch passes its pid to every worker)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if b"engine.worker" not in (entry / "cmdline").read_bytes():
                continue
            environ = (entry / "environ").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and f"SHARDLAB_PARENT_PID={server_pid}".encode() in environ:
            found.append(int(entry.name))
    return found


class MemorySampler(threading.Thread):
    def __init__(self, pid: int, every_s: float = 0.5):
        super().__init__(daemon=True)
        self.pid, self.every_s, self.peak, self._done = pid, every_s, 0, threading.Event()

    def run(self):
        while not self._done.is_set():
            self.peak = max(self.peak, tree_rss_bytes(self.pid))
            self._done.wait(self.every_s)

    def stop(self) -> int:
        self._done.set()
        self.join()
        return self.peak


def measure(sessions: int = 30, env: dict | None = None, page_path: str | tuple[str, ...] = "data-parallel",
            stop_midway: bool = False, close_tabs: int = 0, result_timeout_s: float = 300) -> dict:
    """`close_tabs`: that many students close their tab right after pressing Run (counted apart). `page_path`:
    the lesson every session opens, or several taken in turn (lessons of different imports, whose first
    script runs on a fresh server overlap: that once exposed a half-imported pandas through Plotly)."""
    paths = [page_path] if isinstance(page_path, str) else list(page_path)
    from playwright.sync_api import sync_playwright

    with serve(env) as (url, proc), sync_playwright() as pw:
        browser = pw.chromium.launch_persistent_context(
            tempfile.mkdtemp(prefix="shardlab-load-"), executable_path=CHROMIUM, args=CHROMIUM_ARGS,
            headless=True, viewport={"width": 1200, "height": 900})
        sampler = MemorySampler(proc.pid)
        sampler.start()
        pages, closed = [], []
        try:
            for i in range(sessions):
                page = browser.new_page()
                page.goto(f"{url}/{paths[i % len(paths)]}")
                pages.append(page)
            for page in pages:
                page.get_by_role("button", name=re.compile(f"^Run .*{RUN_BUTTON}$")).wait_for(timeout=180_000)
            pressed = [page.evaluate(WATCH, RUN_BUTTON) for page in pages]  # as fast as a class
            for page in pages[:close_tabs]:
                page.close()
            closed, pages, pressed = pages[:close_tabs], pages[close_tabs:], pressed[close_tabs:]
            sessions -= close_tabs
            states = [None] * sessions
            stopped_after = None
            deadline = time.monotonic() + result_timeout_s
            while time.monotonic() < deadline:
                time.sleep(1.0)
                for i, page in enumerate(pages):
                    if states[i] is None or states[i][2] is None:
                        with contextlib.suppress(Exception):  # a page the stopped server left behind
                            states[i] = page.evaluate(STATE)
                if all(st and st[2] is not None for st in states):
                    break
                if stop_midway and any(st and st[1] is not None and st[2] is None for st in states):
                    stopped_after = stop(proc)
                    break
            exceptions = 0  # a lesson that raised shows Streamlit's exception box, wherever on the page
            for page in pages:
                with contextlib.suppress(Exception):
                    exceptions += page.locator('[data-testid="stException"]').count()
        finally:
            peak = sampler.stop()
            for page in pages:
                with contextlib.suppress(Exception):
                    page.close()
            browser.close()
        server_pid = proc.pid
        exit_s, killed = stop(proc) if stopped_after is None else stopped_after
    deadline = time.monotonic() + 5.0  # workers whose parent has gone notice within a second or two
    while workers_of(server_pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    states = [st or [p, None, None, None] for st, p in zip(states, pressed, strict=True)]
    waits = [(done - p) / 1e3 for p, _, done, _ in states if done is not None]
    now_ms = time.time() * 1e3
    without_status = [((seen if seen is not None else now_ms) - p) / 1e3 for p, seen, _, _ in states]
    return {
        "sessions": sessions,
        "closed_tabs": len(closed),
        "completed": sum(bool(v) for *_, v in states),
        "messages": sum(done is not None and not v for _, _, done, v in states),
        "unfinished": sum(done is None for _, _, done, _ in states),
        "exceptions": exceptions,
        "wait_p50_s": statistics.median(waits) if waits else None,
        "wait_p95_s": sorted(waits)[max(0, round(0.95 * len(waits)) - 1)] if waits else None,
        "wait_max_s": max(waits) if waits else None,
        "longest_without_status_s": max(without_status) if without_status else None,
        "server_peak_rss_mb": peak / 2**20,
        "server_exit_s": exit_s,
        "server_had_to_be_killed": killed,
        "workers_left": len(workers_of(server_pid)),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=30)
    ap.add_argument("--no-cache", action="store_true", help="SHARDLAB_RESULT_CACHE=0: every press runs")
    ap.add_argument("--stop-midway", action="store_true", help="stop the server once the first run executes")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    env = {"SHARDLAB_RESULT_CACHE": "0"} if args.no_cache else {}
    r = measure(args.sessions, env, stop_midway=args.stop_midway)
    if args.json:
        print(json.dumps(r, indent=1))
        return 0
    print(f"{r['sessions']} sessions ({'cache off' if args.no_cache else 'cache on'}"
          f"{', server stopped midway' if args.stop_midway else ''}): {r['completed']} verified results, "
          f"{r['messages']} messages, {r['unfinished']} unfinished, {r['exceptions']} pages with an exception")
    if r["wait_p50_s"] is not None:
        print(f"  wait from Run to result: p50 {r['wait_p50_s']:.1f} s, p95 {r['wait_p95_s']:.1f} s, "
              f"max {r['wait_max_s']:.1f} s")
    print(f"  longest without seeing a queue position or result: {r['longest_without_status_s']:.1f} s")
    killed = " (killed: it did not stop)" if r["server_had_to_be_killed"] else ""
    print(f"  server peak memory (server + workers): {r['server_peak_rss_mb']:,.0f} MB; "
          f"stopped in {r['server_exit_s']:.1f} s{killed}; worker processes left: {r['workers_left']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

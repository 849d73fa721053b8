"""How the app is served: loopback only unless the teacher opts in, Streamlit's protections on."""

import os
import socket
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_config_keeps_the_protections_on():
    cfg = tomllib.loads((ROOT / ".streamlit" / "config.toml").read_text())
    server = cfg["server"]
    assert server["address"] == "127.0.0.1"
    assert server["enableXsrfProtection"] is True and server["enableCORS"] is True
    assert server["maxUploadSize"] <= 1
    assert cfg["client"]["showErrorDetails"] == "none"  # no traceback (paths, code) reaches a browser


def test_run_sh_opts_in_to_the_network_with_one_flag():
    text = (ROOT / "run.sh").read_text()
    assert '"--network"' in text and "--server.address 0.0.0.0" in text


def _listening_addresses(port: int) -> set[str]:
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            addr, hexport = local.split(":")
            if state == "0A" and int(hexport, 16) == port:  # 0A: LISTEN
                found.add(addr)
    return found


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's socket table")
def test_the_app_listens_on_loopback_by_default():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "streamlit", "run", "app.py", "--server.headless", "true",
                             "--server.port", str(port)], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2):
                    break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "streamlit did not start"
                time.sleep(0.3)
        assert _listening_addresses(port) == {"0100007F"}  # 127.0.0.1, and no IPv6 or wildcard socket
    finally:
        proc.terminate()
        proc.wait(15)

"""How the app is served: loopback only unless the teacher opts in, Streamlit's protections on."""

import os
import tomllib
from pathlib import Path

import pytest

from bench.bench_classroom import serve

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
    with serve() as (url, _proc):  # no address given: what .streamlit/config.toml says
        port = int(url.rsplit(":", 1)[1])
        assert _listening_addresses(port) == {"0100007F"}  # 127.0.0.1, and no IPv6 or wildcard socket

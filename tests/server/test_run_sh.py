"""./run.sh as a teacher starts it: the settings checked before the server starts, the address to give the
class. Run on a copy of the script whose .venv/bin/python stands in for Streamlit (it prints the command it
was given), so nothing is served and nothing is installed."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STANDIN = f"""#!/bin/sh
if [ "$1" = "-m" ] && [ "$2" = "server.settings" ]; then
  PYTHONPATH={ROOT} exec {sys.executable} "$@"
fi
echo "streamlit $*"
"""
HOSTNAME = """#!/bin/sh
if [ "$1" = "-I" ]; then printf '%s\\n' "$FAKE_ADDRESSES"; else printf '%s\\n' "$FAKE_NAME"; fi
"""


@pytest.fixture
def run_sh(tmp_path):
    for name in ("run.sh", "scripts/venv.sh", "requirements.txt"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    venv = tmp_path / ".venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").write_text(STANDIN)
    (venv / "python").chmod(0o755)
    # requirements already installed, as scripts/venv.sh records it: it installs nothing
    digest = subprocess.run(["sha256sum", "requirements.txt"], cwd=tmp_path, capture_output=True, text=True,
                            check=True).stdout.split()[0]
    (tmp_path / ".venv" / ".requirements.sha").write_text(digest + "\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "hostname").write_text(HOSTNAME)
    (bin_dir / "hostname").chmod(0o755)

    def run(*args, addresses="192.0.2.7 10.0.0.1", name="classbox", **env):
        environ = {k: v for k, v in os.environ.items() if not k.startswith(("SHARDLAB_", "STREAMLIT_"))}
        environ.update(PATH=f"{bin_dir}:{environ['PATH']}", PYTHON=sys.executable, FAKE_ADDRESSES=addresses,
                       FAKE_NAME=name, **env)
        return subprocess.run(["bash", str(tmp_path / "run.sh"), *args], env=environ, capture_output=True,
                              text=True, timeout=60)

    return run


@pytest.mark.parametrize("env", [{"SHARDLAB_MAX_STEPS": "abc"}, {"SHARDLAB_MAX_WORLD": "-3"}])
def test_a_malformed_setting_stops_it_before_the_server_starts(run_sh, env):
    """It had started, its health check said ok, and the error came when a student opened a page."""
    done = run_sh(**env)
    assert done.returncode == 2 and "streamlit" not in done.stdout
    (name,) = env
    assert f"ShardLab's settings: {name}=" in done.stderr and "docs/classroom.md" in done.stderr


def test_good_settings_start_the_server(run_sh):
    done = run_sh(SHARDLAB_MAX_STEPS="5,000")
    assert done.returncode == 0 and done.stdout.startswith("streamlit -m streamlit run app.py")


@pytest.mark.parametrize("args, url", [
    (("--network",), "http://192.0.2.7:8501"),
    (("--network", "--server.port", "8600"), "http://192.0.2.7:8600"),
    (("--server.port=8700", "--network"), "http://192.0.2.7:8700"),
])
def test_the_address_printed_has_the_port_chosen(run_sh, args, url):
    """It had always said 8501 ("or the --server.port you chose")."""
    done = run_sh(*args)
    assert done.returncode == 0 and f"students open {url}\n" in done.stderr
    assert "--server.address 0.0.0.0" in done.stdout


def test_without_an_address_it_names_the_machine_or_says_where_to_look(run_sh):
    """`hostname -I` printing nothing had given "http://:8501"."""
    assert "students open http://classbox:8501" in run_sh("--network", addresses="").stderr
    said = run_sh("--network", addresses="", name="").stderr
    assert "http://:" not in said and "port 8501" in said


@pytest.mark.parametrize("port", ["abc", "99999", "-5"])
def test_a_port_that_is_no_port_stops_it_before_the_address_is_printed(run_sh, port):
    """It had printed "students open http://...:abc"; 99999 had ended in a 52-line traceback."""
    done = run_sh("--network", "--server.port", port)
    assert done.returncode == 2 and "streamlit" not in done.stdout and "students open" not in done.stderr
    assert "must be a whole number from 1 to 65535" in done.stderr and "Traceback" not in done.stderr


def test_a_port_in_use_names_another(run_sh):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = run_sh("--server.port", str(port))
    assert done.returncode == 2 and "streamlit" not in done.stdout
    assert f"port {port} cannot be used" in done.stderr and "choose another with --server.port" in done.stderr


def test_a_misspelt_setting_is_named_not_ignored(run_sh):
    """SHARDLAB_MAX_CONCURENT=2 had started a server running one at a time, without a word."""
    done = run_sh(SHARDLAB_MAX_CONCURENT="2")
    assert done.returncode == 2 and "streamlit" not in done.stdout
    assert "SHARDLAB_MAX_CONCURENT is not one of its settings (did you mean SHARDLAB_MAX_CONCURRENT?)" in done.stderr


def test_another_server_from_the_same_folder_is_said(run_sh, tmp_path):
    """A second server had started without a word: two queues on the same cores, neither's limits holding."""
    other = subprocess.Popen(["bash", "-c", 'exec -a "python -m streamlit run app.py --server.port 8123" sleep 60'],
                             cwd=tmp_path)
    try:
        done = run_sh()
    finally:
        other.kill()
        other.wait()
    assert done.returncode == 0 and done.stdout.startswith("streamlit -m streamlit run app.py")
    assert f"another ShardLab server is running from this folder (process {other.pid}, port 8123)" in done.stderr
    assert "another ShardLab server" not in run_sh().stderr  # and none once it has stopped

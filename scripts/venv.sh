# Sourced by run.sh and test.sh: make .venv and install requirements.txt into it when it changed.
set -euo pipefail
PY=${PYTHON:-python3}
if ! command -v "$PY" >/dev/null 2>&1; then
  echo "ShardLab needs Python 3.11 or newer: install it (Debian: apt-get install -y python3 python3-venv)." >&2
  exit 2
fi
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "ShardLab needs Python 3.11 or newer; $PY is $("$PY" --version 2>&1)." >&2
  exit 2
fi
if [ ! -x .venv/bin/python ]; then
  if ! "$PY" -m venv .venv 2>/dev/null; then
    rm -rf .venv
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
      echo "Installing python3-venv (Debian) ..."
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv
      "$PY" -m venv .venv
    else
      echo "Python's venv module is missing: run 'sudo apt-get install -y python3-venv', then try again." >&2
      exit 2
    fi
  fi
fi
stamp=.venv/.requirements.sha
want=$(sha256sum requirements.txt | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "Installing requirements into .venv (first run takes a few minutes) ..."
  .venv/bin/python -m pip install --disable-pip-version-check -q --upgrade pip
  .venv/bin/python -m pip install --disable-pip-version-check -q -r requirements.txt
  echo "$want" > "$stamp"
fi

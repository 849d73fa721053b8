#!/usr/bin/env bash
# Install what the tests need (once) and run the whole suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")"
source scripts/venv.sh
if ! [ -x /usr/bin/chromium ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "Installing Debian's chromium for the browser tests ..."
    # Ubuntu has no chromium package (its chromium-browser is a snap): a failed install skips the browser tests
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } || \
      echo "NOTE: could not install chromium; the browser tests need it at /usr/bin/chromium and will be skipped." >&2
  else
    echo "NOTE: the browser tests need Debian's Chromium at /usr/bin/chromium and will be skipped." >&2
    echo "      Install it with: sudo apt-get install -y chromium (Debian; on Ubuntu, a Chromium at that path)" >&2
  fi
fi
# Style is kept by the tools: pyflakes, import order and line length (pyproject.toml), before any test runs.
.venv/bin/ruff check . || { echo "ruff found the problems above: fix them (many with: .venv/bin/ruff check . --fix)" >&2; exit 1; }
exec .venv/bin/python -m pytest "$@"

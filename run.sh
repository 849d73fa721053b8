#!/usr/bin/env bash
# Install what ShardLab needs (once) and start the app on http://localhost:8501 (this machine only).
#   ./run.sh --network    also listen on this machine's network addresses (a classroom server:
#                         docs/classroom.md); any other argument goes to Streamlit (--server.port 8600)
set -euo pipefail
cd "$(dirname "$0")"
source scripts/venv.sh
args=()
for a in "$@"; do
  if [ "$a" = "--network" ]; then
    args+=(--server.address 0.0.0.0)
    echo "Listening on every network address of this machine: students open http://$(hostname -I 2>/dev/null | cut -d' ' -f1 || hostname):8501 (or the --server.port you chose)" >&2
  else
    args+=("$a")
  fi
done
exec .venv/bin/python -m streamlit run app.py --server.headless true --browser.gatherUsageStats false ${args[@]+"${args[@]}"}

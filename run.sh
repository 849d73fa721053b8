#!/usr/bin/env bash
# Install what ShardLab needs (once) and start the app on http://localhost:8501 (this machine only).
#   ./run.sh --network    also listen on this machine's network addresses (a classroom server:
#                         docs/classroom.md); any other argument goes to Streamlit (--server.port 8600)
set -euo pipefail
cd "$(dirname "$0")"
source scripts/venv.sh
args=()
network=0
port=${STREAMLIT_SERVER_PORT:-8501}  # .streamlit/config.toml's; an argument below overrides it, as for Streamlit
previous=""
for a in "$@"; do
  case "$a" in
    "--network") network=1; args+=(--server.address 0.0.0.0) ;;
    --server.port=*) port=${a#--server.port=}; args+=("$a") ;;
    *) if [ "$previous" = "--server.port" ]; then port=$a; fi; args+=("$a") ;;
  esac
  previous=$a
done
# The SHARDLAB_* settings and the port, checked before the server starts: a malformed setting had shown no
# sign (health said ok) until a student opened a page, a taken port came after the address was printed. It
# prints what to change and exits 2.
check=(--port "$port")
if [ "$network" = 1 ]; then check+=(--network); fi
.venv/bin/python -m server.settings "${check[@]}" || exit 2
if [ "$network" = 1 ]; then
  # the first address `hostname -I` gives, else the machine's name; neither: no "http://:8501" to copy
  host=$(hostname -I 2>/dev/null | awk '{print $1}') || host=""
  if [ -z "$host" ]; then host=$(hostname 2>/dev/null) || host=""; fi
  if [ -n "$host" ]; then
    echo "Listening on every network address of this machine: students open http://$host:$port" >&2
  else
    echo "Listening on every network address of this machine: students open port $port of its address (ip addr shows it)" >&2
  fi
fi
exec .venv/bin/python -m streamlit run app.py --server.headless true --browser.gatherUsageStats false ${args[@]+"${args[@]}"}

#!/usr/bin/env bash
# Install what ShardLab needs (once) and start the app on http://localhost:8501
set -euo pipefail
cd "$(dirname "$0")"
source scripts/venv.sh
exec .venv/bin/python -m streamlit run app.py --server.headless true --browser.gatherUsageStats false "$@"

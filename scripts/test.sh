#!/usr/bin/env bash
# The test command (README; .ci/run calls it): set up from scratch if needed (venv, patched llama-cpp-python,
# chromium for the chat-page test), then run the whole suite.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
. "$here/scripts/setup_env.sh"
bash "$here/scripts/install_test_deps.sh"  # chromium + chromedriver for the chat-page test, when missing
cd "$here"
python -m pytest -q tests "$@"

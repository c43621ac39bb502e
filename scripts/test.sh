#!/usr/bin/env bash
# The test command (README; .ci/run calls it): set up from scratch if needed, then run the whole suite.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
. "$here/scripts/setup_env.sh"
cd "$here"
python -m pytest -q tests "$@"

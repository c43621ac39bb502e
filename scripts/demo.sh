#!/usr/bin/env bash
# The main job on the bundled default (README): set up if needed, then `llamapack demo`.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
. "$here/scripts/setup_env.sh"
llamapack demo "$@"

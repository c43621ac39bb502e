#!/usr/bin/env bash
# Set up a fresh machine for llamapack: a venv with the package, and the patched llama-cpp-python built from
# the pinned sdist (plus an unpatched build of the same sources, used by the bit-exact tests).
# Usage: source scripts/setup_env.sh   (idempotent; the build is cached in ~/.cache/llamapack)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${LLAMAPACK_VENV:-$here/.venv}"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
. "$venv/bin/activate"
python -m pip install -q --upgrade pip
python -m pip install -q -e "$here[test]"
cache="${LLAMAPACK_CACHE:-$HOME/.cache/llamapack}"
if ! python -c "import llamapack.native as n, sys; sys.exit(0 if n.is_patched() else 1)" 2>/dev/null \
   || [ ! -f "$cache/vanilla/libllama.so" ] || [ "${LLAMAPACK_REBUILD:-0}" = 1 ]; then
    python "$here/scripts/build_llama.py" --vanilla-dir "$cache/vanilla"
fi
set +euo pipefail

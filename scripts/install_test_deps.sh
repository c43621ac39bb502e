#!/usr/bin/env bash
# System packages the test suite needs beyond the venv: headless Chromium and its driver for the chat-page
# test (Debian/Ubuntu: chromium, chromium-driver). Installed only when missing, with apt-get as root (or
# through sudo); elsewhere it says what to install and the chat-page test fails with the same advice.
# Usage: bash scripts/install_test_deps.sh   (scripts/test.sh runs it)
set -euo pipefail
if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
    exit 0
fi
packages="chromium chromium-driver"
if command -v apt-get >/dev/null; then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq && apt-get install -y -qq $packages
        exit 0
    elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
        sudo apt-get update -qq && sudo apt-get install -y -qq $packages
        exit 0
    fi
fi
echo "install_test_deps: chromium and chromedriver are missing and cannot be installed here; install" \
     "$packages (Debian/Ubuntu) as root for the chat-page test" >&2

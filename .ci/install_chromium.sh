#!/usr/bin/env bash
# Installs headless Chromium and its WebDriver for the playground's browser test (tests/clients/
# test_playground.py). Debian packages; needs root. A no-op when both are already installed.
# Run by .ci/run before the suite (never by a test: the suite installs nothing).
set -euo pipefail
if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends chromium chromium-driver

#!/usr/bin/env bash
# Make sure Debian's Chromium is installed (the dashboard test drives /usr/bin/chromium
# headless through Playwright; nothing downloads a browser of its own).
set -euo pipefail
if [ -x /usr/bin/chromium ]; then
  exit 0
fi
SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
/usr/bin/chromium --version

#!/usr/bin/env bash
# bubblewrap isolates untrusted code (lit_marl/sandbox.py). Install it with apt when it is missing
# and we may (root, or password-less sudo). Without it the sandbox falls back to rlimits + timeout
# and says so, and the isolation tests skip, so a failed install is a warning, not an error.
command -v bwrap >/dev/null && exit 0
if [ "$(id -u)" -eq 0 ]; then SUDO=""; elif sudo -n true 2>/dev/null; then SUDO="sudo -n"; else
  echo "warning: bubblewrap is missing; install it for isolation: sudo apt-get install bubblewrap"; exit 0
fi
(export DEBIAN_FRONTEND=noninteractive; timeout 300 $SUDO apt-get update -qq \
  && timeout 300 $SUDO apt-get install -y -qq bubblewrap) >/dev/null 2>&1 \
  || echo "warning: could not install bubblewrap; untrusted code runs without isolation, its tests skip"
exit 0

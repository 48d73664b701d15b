#!/usr/bin/env bash
set -euo pipefail
.venv/bin/flashflex --version

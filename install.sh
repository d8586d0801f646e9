#!/usr/bin/env bash
# Installs sao_jax and its pinned dependencies into the active Python environment.
set -euo pipefail
cd "$(dirname "$0")"
python -m pip install -q --upgrade pip
python -m pip install -q -r requirements.txt
python -m pip install -q --no-deps -r requirements-nodeps.txt
python -m pip install -q --no-deps -e .

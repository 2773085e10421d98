#!/usr/bin/env bash
# Creates .venv in the repository and installs the pinned CPU stack (requirements/cpu.txt)
# plus this package in editable mode. Idempotent: a stamp keyed on the pins skips reinstalls.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
stamp=".venv/.installed-$(cat requirements/cpu.txt setup.py | sha256sum | cut -c1-16)"

if [ "${1:-}" = "--freeze" ]; then
    # Rewrite the pins from the current venv, keeping the header comment.
    { grep '^#' requirements/cpu.txt; .venv/bin/python -m pip freeze --exclude-editable; } > requirements/cpu.txt.new
    mv requirements/cpu.txt.new requirements/cpu.txt
    exit 0
fi

if [ -f "$stamp" ]; then
    exit 0
fi

echo "setup: creating .venv and installing the pinned stack (several minutes the first time)"
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip() {
    # This machine's pip.conf names extra local indexes that may not exist: drop that noise.
    .venv/bin/python -m pip --disable-pip-version-check "$@" 2> >(grep -v "is ignored: it is neither" >&2)
}
pip install -q pip==26.3 setuptools==84.2.1 wheel==0.47.0
pip install -q --no-deps -r requirements/cpu.txt
pip install -q --no-deps --no-build-isolation -e .
.venv/bin/python -c "import sglang, transformers, torch, torchao, sglang_hf_backend"
rm -f .venv/.installed-*
touch "$stamp"
echo "setup: done"

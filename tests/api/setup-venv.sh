#!/usr/bin/env bash
# Creates .venv-api/ (gitignored) with the official OpenAI Python SDK, which tests/api.rs uses
# as a real SSE client. Idempotent: a venv whose `import openai` works is left as it is.
# Prints the venv's python on stdout; progress goes to stderr. Needs python3 and PyPI.
set -euo pipefail
cd "$(dirname "$0")/../.."
venv=.venv-api
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import openai" 2>/dev/null; then
    echo "$PWD/$venv/bin/python"
    exit 0
fi
# Several test processes may get here at once: one creates, the others wait for it.
exec 9>".venv-api.lock"
flock 9
if ! { [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import openai" 2>/dev/null; }; then
    echo "[api-venv] creating $venv with the openai SDK" >&2
    rm -rf "$venv"
    if ! python3 -m venv "$venv"; then
        # Debian's python3 needs python3-venv for `-m venv` (ensurepip).
        echo "[api-venv] installing python3-venv" >&2
        sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
        $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq python3-venv >/dev/null
        rm -rf "$venv"
        python3 -m venv "$venv"
    fi
    "$venv/bin/pip" install --quiet --disable-pip-version-check "openai>=1.40,<4" >&2
fi
echo "$PWD/$venv/bin/python"

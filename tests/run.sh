#!/usr/bin/env bash
# The one test command: set up (or reuse) .venv, install nanorl with its test deps, run every test.
#   bash tests/run.sh            # all tests
#   bash tests/run.sh -k engine  # extra args go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
PY=.venv/bin/python
$PY -m pip install -q --upgrade pip >/dev/null
if ! command -v nvidia-smi >/dev/null 2>&1 && ! $PY -c "import torch" 2>/dev/null; then
    # no GPU: take the small CPU build of torch rather than a multi-GB CUDA one
    $PY -m pip install -q torch==2.13.0 || $PY -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu
fi
$PY -m pip install -q -e ".[dev]"
# the browser test drives Debian's headless Chromium; install it when we can (root with apt-get)
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
        || echo "warning: could not install chromium; the browser test will be skipped"
fi
# the python sandbox runs model-written code in bubblewrap's namespaces; without it the escape tests are skipped
if ! command -v bwrap >/dev/null 2>&1 && [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null) \
        || echo "warning: could not install bubblewrap; the sandbox escape tests will be skipped"
fi
# torch.compile on the CPU (the compiled-FSDP test) builds its kernels with a C++ compiler
if ! command -v g++ >/dev/null 2>&1 && [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++ >/dev/null) \
        || echo "warning: could not install g++; the compiled-FSDP test will be skipped"
fi
# not root: nothing was installed; one line names what is missing (the tests that need it are skipped, the rest run)
if [ "$(id -u)" != "0" ]; then
    NEED=""
    for c in chromium:chromium bwrap:bubblewrap g++:g++; do command -v "${c%%:*}" >/dev/null 2>&1 || NEED="$NEED ${c#*:}"; done
    [ -z "$NEED" ] || echo "note: not root, so not installed:$NEED (apt-get install$NEED); the tests that need them are skipped"
fi
set +e
# tests run in parallel: one worker per core (at most 8), each test on one thread, handed out one at a time with
# the slow ones first (tests/conftest.py) so the workers finish together
WORKERS=$(nproc); [ "$WORKERS" -gt 8 ] && WORKERS=8
$PY -m pytest -q -n "$WORKERS" --dist load --maxschedchunk 1 --durations=15 "$@"
rc=$?
set -e
if [ $rc -eq 5 ]; then
    echo "error: pytest collected no tests" >&2
    exit 1
fi
exit $rc

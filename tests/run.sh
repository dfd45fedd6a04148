#!/usr/bin/env bash
# The one test command: set up (or reuse) .venv, install nanorl with its test deps, run every test.
#   bash tests/run.sh            # all tests
#   bash tests/run.sh -k engine  # extra args go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
# .venv with nanorl, its test deps and torch; bubblewrap (the sandbox tests), chromium (the browser test) and g++ (the
# compiled-FSDP test) from apt-get when root: a test whose tool is missing is skipped, and one line names it
source install.sh bwrap:bubblewrap chromium:chromium g++:g++
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

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
# The whole suite (no arguments) then runs its numerically sensitive files twice more, their fast tests only:
# - on other CPU kernels: torch's vector kernels one level down from this CPU's (AVX-512 -> AVX2, AVX2 -> scalar),
#   MKL and oneDNN held to AVX2, two threads a worker. A float comparison whose tolerance was picked on one CPU, or a
#   bit-identity between paths whose kernels differ by CPU, fails here before it fails on a user's machine. Two
#   workers of two threads on two cores: OpenMP's idle threads sleep (OMP_WAIT_POLICY=PASSIVE) instead of spinning
#   on the cores the other worker needs (spinning took ~5x the CPU time).
# - in CUDA's dtype layout (NANORL_CUDA_DTYPES=1: bf16 engine, KV cache and embedding): the tests marked `fp32`
#   (exactness against an fp32 reference by design) are skipped, each naming why.
SENSITIVE=(tests/test_gpt.py tests/test_engine.py tests/test_sampling.py tests/test_lora.py tests/test_hf.py
    tests/test_multiturn.py tests/test_rl_trainer.py tests/test_rl_math.py tests/test_rl_gspo_tis.py tests/test_optim.py
    tests/test_samples.py tests/test_sft.py)
if [ $# -eq 0 ]; then
    OTHER=$($PY -c "import torch; print('avx2' if torch.backends.cpu.get_cpu_capability().startswith('AVX512') else 'default')")
    echo "== the numerically sensitive files on other kernels: ATEN_CPU_CAPABILITY=$OTHER, MKL and oneDNN at AVX2, 2 threads"
    ATEN_CPU_CAPABILITY=$OTHER MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 NANORL_TEST_THREADS=2 OMP_WAIT_POLICY=PASSIVE \
        $PY -m pytest -q -n "$WORKERS" --dist load -m "not slow" "${SENSITIVE[@]}" || rc=1
    echo "== the numerically sensitive files in CUDA's dtype layout: NANORL_CUDA_DTYPES=1"
    NANORL_CUDA_DTYPES=1 $PY -m pytest -q -n "$WORKERS" --dist load -m "not slow" "${SENSITIVE[@]}" || rc=1
fi
set -e
if [ $rc -eq 5 ]; then
    echo "error: pytest collected no tests" >&2
    exit 1
fi
exit $rc

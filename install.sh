# The environment speedrun.sh and tests/run.sh run in, sourced by both from the repo root:
#   source install.sh bwrap:bubblewrap [command:package ...]   # apt packages, each named by the command it provides
# It makes .venv and installs nanorl into it with torch: on a CUDA machine (unless NANORL_TINY=1) the build whose
# CUDA this driver runs, plus the compiler torch.compile needs; elsewhere the small CPU build. Then the packages named
# (bubblewrap: the python sandbox), from apt-get when root. Sets PY (the venv's python) and TINY (1: no CUDA).
# NANORL_SKIP_INSTALL=1 installs nothing: the environment must already be complete.
INSTALL=1
[ "${NANORL_SKIP_INSTALL:-0}" = "1" ] && INSTALL=0
fail() { echo "!! $*" >&2; exit 1; }
# what a minimal image lacks comes from apt-get when we can (root, apt-get, installs allowed), else we name it
can_apt() { [ $INSTALL = 1 ] && [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; }
apt_install() { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null; }

if [ ! -x .venv/bin/python ]; then
    # Debian and Ubuntu ship venv's ensurepip apart, in python3-venv
    if ! python3 -c "import ensurepip" 2>/dev/null && can_apt; then apt_install python3-venv; fi
    VENV_NEW=0; [ -e .venv ] || [ -L .venv ] || VENV_NEW=1  # a failed venv is removed only if we created it: never the user's .venv
    python3 -m venv .venv || { [ $VENV_NEW = 0 ] || rm -rf .venv; fail "python3 -m venv failed: apt-get install python3-venv"; }
fi
PY=.venv/bin/python
if [ $INSTALL = 1 ]; then $PY -m pip install -q --upgrade pip >/dev/null; fi
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && [ "${NANORL_TINY:-0}" != "1" ]; then
    TINY=0
    # torch.compile's Triton builds its kernel launchers with a C compiler, against Python.h
    MISSING=$($PY -m nanorl.gpu_setup toolchain)
    if [ -n "$MISSING" ] && can_apt; then apt_install $MISSING; MISSING=$($PY -m nanorl.gpu_setup toolchain); fi
    [ -z "$MISSING" ] || fail "torch.compile needs a C compiler and Python's headers: apt-get install $MISSING"
    # the torch build whose CUDA this driver runs: the default wheel's may be newer, and then torch sees no GPU
    read -r WHEEL_CUDA WHEEL_INDEX TORCH_SPEC <<< "$($PY -m nanorl.gpu_setup wheel)"
    [ -n "${WHEEL_INDEX:-}" ] || exit 1  # gpu_setup said why
    if [ $INSTALL = 1 ]; then
        # a torch for another CUDA (or a +cpu one) also meets the version pin, so pip would keep it: remove it
        [ "$($PY -c 'import torch; print(torch.version.cuda)' 2>/dev/null)" = "$WHEEL_CUDA" ] \
            || $PY -m pip uninstall -q -y torch 2>/dev/null || true
        $PY -m pip install -q "$TORCH_SPEC" --index-url "$WHEEL_INDEX"
    fi
else
    TINY=1
    if [ $INSTALL = 1 ] && ! $PY -c "import torch" 2>/dev/null; then  # the small CPU build, not a multi-GB CUDA one
        $PY -m pip install -q torch==2.13.0 || $PY -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu
    fi
fi
if [ $INSTALL = 1 ]; then $PY -m pip install -q -e ".[dev]"; fi

# the packages the caller named (a command missing here: its tests are skipped, or the run says what it cannot do)
NOT_INSTALLED=""
for want in "$@"; do
    command -v "${want%%:*}" >/dev/null 2>&1 && continue
    if can_apt; then apt_install "${want#*:}" || echo "warning: could not install ${want#*:}" >&2
    else NOT_INSTALLED="$NOT_INSTALLED ${want#*:}"; fi
done
[ -z "$NOT_INSTALLED" ] || echo "note: not installed:$NOT_INSTALLED (apt-get install$NOT_INSTALLED); what needs it is skipped" >&2

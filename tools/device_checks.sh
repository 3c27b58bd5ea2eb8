#!/usr/bin/env bash
# Every check that needs a GPU, in one bounded run, the headline figures first: build the
# models (untimed work out of the benchmarks), a two-engine smoke test (engines sharing the
# device), the issues' benchmarks, then the CUDA tests. Results go to $OUT (default
# ./device-results): one log and one JSON per step (each benchmark rewrites its JSON after
# every figure, so a step cut short keeps what it measured). Each step has its own time
# limit, cut to what is left of DEVICE_BUDGET_S (default 570 s: one command of a borrowed
# machine); steps that no longer fit are skipped and named. A failing step does not stop the
# others; the exit status says whether any failed or was skipped.
#
#   tools/device_checks.sh                      # on the GPU machine, every step
#   tools/device_checks.sh bench_embed_tiny tests   # only these steps
#   tools/device_checks.sh --quick              # the same steps, tiny sizes, on any machine
set -uo pipefail
cd "$(dirname "$0")/.."
# The benchmarks run as scripts: the checkout must be importable without an install.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# The device has no network: no library may wait on the hub.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# The commit, for the benchmarks' JSON (a copied checkout may have no git metadata).
MPENGINE_COMMIT=${MPENGINE_COMMIT:-$(git rev-parse HEAD 2>/dev/null || true)}
export MPENGINE_COMMIT
out=${OUT:-device-results}
mkdir -p "$out"
python=${PYTHON:-python3}
quick=0
if [ "${1:-}" = "--quick" ]; then
    quick=1
    shift
fi
only=" $* "
device=cuda
[ $quick = 1 ] && device=cpu
budget=${DEVICE_BUDGET_S:-570}
failed=0

step() {  # step NAME SECONDS CMD...
    local name=$1 limit=$2
    shift 2
    if [ "$only" != "  " ] && [[ "$only" != *" $name "* ]]; then
        return
    fi
    local left=$((budget - SECONDS))
    if [ "$left" -lt 30 ]; then
        echo "== $name: skipped, $left s of the budget left" | tee -a "$out/steps.log"
        failed=1
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $name ($limit s): $*" | tee -a "$out/steps.log"
    local started=$SECONDS
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    echo "   exit $rc after $((SECONDS - started)) s" | tee -a "$out/steps.log"
    tail -n 25 "$out/$name.log"
    [ $rc = 0 ] || failed=1
}

{
    "$python" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
    nvidia-smi -q 2>/dev/null | head -n 60
} >"$out/device.txt" 2>&1
head -n 1 "$out/device.txt"
# Every dependency, in the first second rather than in each step's log.
"$python" -c "import mpengine, msgspec, zmq, posix_ipc, transformers, tokenizers, pytest" ||
    { echo "== a dependency is missing: nothing run" | tee -a "$out/steps.log"; exit 1; }
if [ $quick = 0 ]; then
    "$python" -c "import torch, triton; assert torch.cuda.is_available(), 'no CUDA device'" ||
        { echo "== no CUDA device or no triton: nothing run" | tee -a "$out/steps.log"; exit 1; }
fi

# Two tiny engines at once, each with its share of the device (or of the CPU's memory).
smoke='
import mpengine, sys
from mpengine import SamplingParams
device = sys.argv[1]
share = {"gpu_memory_utilization": 0.4} if device == "cuda" else {}
engines = [mpengine.launch(model="tiny", device=device, log_level="WARNING", **share)
           for _ in range(2)]
try:
    for engine in engines:
        with engine.client() as client:
            out = client.generate([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
            assert len(out.token_ids) == 4, out
            print(engine.model.device, engine.model.dtype, engine.model.num_blocks, "blocks")
finally:
    for engine in engines:
        engine.shutdown()
'

if [ $quick = 1 ]; then
    step build 300 "$python" -c "from mpengine.models.resolve import resolve_model as r
for name in ('tiny', 'tiny-bert', 'tiny-embed'): print(r(name))"
    step smoke 120 "$python" -c "$smoke" cpu
    step bench_engine_tiny 300 "$python" tools/bench_engine.py --device cpu --models tiny \
        --runtimes serial processes-depth1 threads-depth1 hf-generate --num-requests 8 \
        --max-tokens 8 --repeats 1 --json "$out/bench_engine_tiny.json"
    step bench_embed_tiny 300 "$python" tools/bench_embed.py --device cpu \
        --models tiny-bert tiny-embed --runtimes processes serial hf-batched \
        --concurrency 8 --rounds 1 --requests 32 --json "$out/bench_embed_tiny.json"
    step bench_executor 300 "$python" tools/bench_executor.py --seqs 4 --contexts 64 \
        --steps 3 --json "$out/bench_executor.json"
    step tests 600 "$python" -m pytest -q -p no:cacheprovider -x \
        tests/unit/test_attention_backends.py tests/unit/test_pooler.py
else
    # The shape models are ~600M random parameters each: built once, off the clock.
    step build 150 "$python" -c "from mpengine.models.resolve import resolve_model as r
for name in ('tiny', 'tiny-bert', 'tiny-embed', 'qwen3-0.6b-shape',
             'qwen3-embedding-0.6b-shape'): print(r(name))"
    step smoke 60 "$python" -c "$smoke" cuda
    # Issue 7: 256 concurrent requests, the Qwen3-0.6B shape and tiny, against HF generate.
    # (processes-depth0, the CPU overlap experiment, is left out: a quarter less start-up.)
    rows="serial processes-depth1 threads-depth1 hf-generate"
    # shellcheck disable=SC2086
    step bench_engine_shape 200 "$python" tools/bench_engine.py --device "$device" \
        --shape qwen3-0.6b --runtimes $rows --num-requests 256 --max-tokens 128 --repeats 3 \
        --json "$out/bench_engine_shape.json"
    # shellcheck disable=SC2086
    step bench_engine_tiny 150 "$python" tools/bench_engine.py --device "$device" \
        --models tiny --runtimes $rows --num-requests 256 --max-tokens 128 --repeats 3 \
        --json "$out/bench_engine_tiny.json"
    # Issue 9: embeddings from concurrent single-sentence clients (ten requests per client
    # at the largest concurrency), the tiny models and the Qwen3-Embedding-0.6B shape.
    step bench_embed_tiny 150 "$python" tools/bench_embed.py --device "$device" \
        --models tiny-bert tiny-embed --concurrency 32 128 --requests 1280 --rounds 2 \
        --json "$out/bench_embed_tiny.json"
    step bench_embed_shape 120 "$python" tools/bench_embed.py --device "$device" \
        --shape qwen3-embedding-0.6b --concurrency 32 128 --requests 1280 --rounds 2 \
        --json "$out/bench_embed_shape.json"
    step bench_executor 120 "$python" tools/bench_executor.py --steps 5 --contexts 128 1024 \
        --json "$out/bench_executor.json"
    # The real kernels and graphs against the torch backend, and the GPU sizing.
    step tests 120 "$python" -m pytest -q -p no:cacheprovider tests/unit/test_attention_backends.py \
        tests/unit/test_executor_gpu_memory.py tests/unit/test_sampler.py \
        tests/e2e/test_executor_triton.py
fi
echo "== done: $([ $failed = 0 ] && echo all passed || echo some failed or were skipped)" |
    tee -a "$out/steps.log"
exit $failed

#!/usr/bin/env bash
# The CUDA half of the tests and benchmarks, in one call on a lent GPU machine (a bare image with torch,
# triton and transformers, no network, 64 MiB of tree per call: no embedded model, see tests/conftest.py).
#
# Prepared on the dev machine first (both folders are git-ignored and travel as the call's `carry`):
#   .whl/            pyzmq, pytest-asyncio and gguf wheels for the machine's Python (pip download ... -d .whl)
#   .gpu/tokenizer/  SmolLM2's tokenizer files (from the converted embedded model in ~/.cache/infer/models)
# Then:  bash benchmarks/gpu_session.sh [tests] [bench] [spec] [kernels] [quant]   (default: all five; a lent
# machine runs at most 10 minutes per call, so give `quant` (~3 minutes) a call of its own)
# Logs and result JSON go to $OUT (or benchmarks/results/ when OUT is unset).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
PARTS=${*:-tests bench spec kernels quant}

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1 INFER_TEST_TOKENIZER_DIR=$PWD/.gpu/tokenizer
export INFER_GIT_REVISION=${INFER_GIT_REVISION:-unknown} INFER_COMPILE_CACHE=/tmp/infer-compile

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, torch.cuda.get_device_name(0))"

for part in $PARTS; do
  case $part in
  tests)
    # The GPU-relevant tests: compiled Triton kernels (bf16 included), CUDA-graph step graphs vs eager,
    # the engine on the kernels, the model against transformers. (The quantized matmul tests run in `quant`.)
    timeout 400 python3 -m pytest -q -p no:cacheprovider --timeout=120 tests/kernels \
        --ignore=tests/kernels/test_quant_triton.py tests/worker/test_step_graphs.py \
        tests/worker/test_step_buckets.py tests/worker/test_engine_kernels.py tests/worker/test_model.py \
        tests/worker/test_sampler.py tests/worker/test_native_decode.py -k "not flags_reach_the_engine_config" 2>&1 | tee "$OUT/gpu-tests.log" | grep -E "passed|failed|FAILED|ERROR" | tail -30
    ;;
  bench)
    timeout 170 python3 benchmarks/step_graphs.py --random-model smollm2-135m --tokenizer .gpu/tokenizer \
        --parts decode offline ttft --batches 1 8 32 128 --dtypes bfloat16 --steps 100 --rounds 3 2>&1 \
        | tee "$OUT/gpu-bench.log" | grep -v "^\s*$" | tail -12
    cp "$(ls -t benchmarks/results/step_graphs-*.json | head -1)" "$OUT/"
    timeout 130 python3 benchmarks/step_graphs.py --random-model llama-1b --tokenizer .gpu/tokenizer \
        --parts decode --batches 1 32 --dtypes bfloat16 --steps 60 2>&1 \
        | tee "$OUT/gpu-bench-1b.log" | grep -v "^\s*$" | tail -4
    cp "$(ls -t benchmarks/results/step_graphs-*.json | head -1)" "$OUT/"
    ;;
  spec)
    # Speculative decoding with CUDA graphs (verification steps replay them: "graph_verification_replays"), batch 1
    # and offline batch 64, with vs without, on a random-weight SmolLM2 shape (no real weights travel: its
    # acceptance is whatever the random model's own repetition gives).
    timeout 150 python3 benchmarks/speculative.py --random-model smollm2-135m --tokenizer .gpu/tokenizer \
        --parts batch1 offline --workloads rewrite random --rounds 3 --max-tokens 96 2>&1 \
        | tee "$OUT/gpu-spec.log" | grep -v "^\s*$" | tail -20
    cp "$(ls -t benchmarks/results/speculative-*.json | head -1)" "$OUT/"
    ;;
  kernels)
    timeout 100 python3 benchmarks/kernels.py --no-cpu 2>&1 | tee "$OUT/gpu-kernels.log" | tail -30
    cp "$(ls -t benchmarks/results/kernels-*.json | head -1)" "$OUT/"
    ;;
  quant)
    # Weight-only quantized matmul (kernels/quant_triton.py): the kernels against the twin, compiled (~60
    # specializations, most of the time), then their bandwidth and a 1B Llama's batch-1 decode against the
    # HBM floor. The benchmark writes its JSON straight to $OUT.
    timeout 240 python3 -m pytest -q -p no:cacheprovider --timeout=150 tests/kernels/test_quant_triton.py \
        tests/worker/test_quantized.py 2>&1 \
        | tee "$OUT/gpu-quant-tests.log" | grep -E "passed|failed|FAILED|ERROR" | tail -20
    timeout 150 python3 benchmarks/quant_gpu.py --out "$OUT" 2>&1 | tee "$OUT/gpu-quant.log" | grep -v "^\s*$" | tail -150
    ;;
  esac
done

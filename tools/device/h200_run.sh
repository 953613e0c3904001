#!/usr/bin/env bash
# One call on the lent H200 (docs/gpu.md says how the call is made and which wheels travel):
# build the C library, then each step in turn, each bounded by its own timeout so that one
# hanging step leaves time for the others, each step's log in $OUT/<step>.log:
#   tests    the one-tensor crossing's tests (CPU checks and the GPU crossings)
#   handoff  omni-bench gpu-handoff --compare: the crossing before / after, interleaved
#   hparts   tools/device/higgs_parts.py: the vocoder's decode eager vs graphs, the frame step (the
#            sampler before / now) at batch 1, 16, 64, on the full random checkpoint (written
#            here first, for higgs below too)
#   htests   the Higgs tests ($HTESTS: the decode windows and graphs, the engine GPU ones)
#   higgs    omni-bench higgs-serve --gpu: a full random checkpoint written here, the Higgs
#            pipeline served and loaded at c = 1, 4, 16, 64, one replica against three
#   higgsbefore  the same on $BEFORE's server and examples/higgs-audio-v2 (a checkout's root,
#            default ../..): the before side of a served comparison ($HIGGS_BEFORE_ARGS)
#   profile  the fast path's crossing under cProfile (sender's send_data, receiver's loop)
#   spin1ms  the crossing again with a 1 ms hot-stream spin (what the wake-up costs)
#   tier     the GPU test tier of docs/gpu.md (one H200)
#   parts    tools/device/crossing_parts.py: what each part of the sender's export costs, for
#            the tree in $BEFORE_TREE (main's checkout, its library built here) and this one
#   ab       tools/device/crossing_ab.py: the crossing of $BEFORE_TREE against this tree (and
#            this tree without the hot-stream poll), interleaved, 2 x 200 at 1 and 64 MiB
#   abpoll   the crossing of $BEFORE_TREE against this tree at its defaults (the adaptive poll)
#            and with the fixed 200 us poll of before, interleaved
#   cpu      tools/device/ring_cpu_cost.py: a stream's CPU cost on its receiver (records every
#            10, 2, 0.5, 0.2 ms), $BEFORE_TREE against this tree, interleaved
#   engine   the engine's GPU tests (graphs, paged kernel, fused kernels, memory, Higgs,
#            steps in flight, the few-row matmul and argmax)
#   gemv     tools/device/gemv_bench.py: the few-row matmul's configurations and the argmax
#            against torch at the engine's shapes (checks first), json in $OUT/gemv.json
#   stepbefore  omni-bench gpu-step (paged only) against BEFORE's engine (a checkout's root,
#            default the tree this one sits in, ../..): the before side of a comparison
#   step     omni-bench gpu-step --profile --host-profile against this tree's engine
#   codec    tools/device/higgs_tokenizer_check.py: our Higgs audio tokenizer against the real
#            torchaudio's reference (encode codes identical, decode SNR, graphs vs eager)
#   qwen     the Qwen3-Omni GPU tests (the fused MoE kernel, the parts on CUDA), then
#            omni-bench gpu-moe --sweep (the kernel against the per-expert loop and the floor)
#   first    the README's "With a GPU" commands as written (a tiny random checkpoint, config
#            resolve --show topology, the example served with no override, one speech
#            request), then the GPU placement test
# STEPS="tests handoff" picks steps (default: all five); TESTS the test files. Only what reads $OUT's limits (8 files)
# lands there: the tables and the logs.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/omni-h200-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/server:$PWD/tools:$PWD/clients:$PWD/transport_ext${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
STEPS=${STEPS:-tests handoff profile higgs tier}
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv
echo "cores: $(nproc)  commit: $(cat COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null)"
cmake -S . -B /tmp/omni-build -DCMAKE_BUILD_TYPE=Release >/dev/null \
  && cmake --build /tmp/omni-build -j 16 2>&1 | grep -E "warning|error|Built target" || exit 1
python3 -c "import omni_transport, torch, transformers; print('abi', omni_transport.abi_version(),
  'torch', torch.__version__, 'transformers', transformers.__version__)"

BEFORE_TREE=${BEFORE_TREE:-$(cd ../.. && pwd)}  # the device copy's root: /work/main's checkout
case " $STEPS " in *" parts "*|*" ab "*|*" cpu "*)
  cmake -S "$BEFORE_TREE" -B /tmp/omni-build-before -DCMAKE_BUILD_TYPE=Release >/dev/null \
    && cmake --build /tmp/omni-build-before -j 16 2>&1 | grep -E "warning|error" ;;
esac

step() {  # step NAME SECONDS COMMAND...: run it (bounded), log it, say its exit code
  local name=$1 limit=$2
  shift 2
  case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
  echo "== $name (at most ${limit} s) $(date -u +%T)"
  timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name rc=$? $(date -u +%T)"
  tail -n "${TAIL:-25}" "$OUT/$name.log"
}

TESTS=${TESTS:-tests/transport/test_tensor_records.py tests/transport/test_cuda_ipc.py \
  tests/wire/test_cuda_packed.py tests/wire/test_cuda_ipc.py tests/transport/test_ring.py}
step tests 120 python3 -m pytest -q -p no:cacheprovider -rs $TESTS
TAIL=12 step handoff 150 python3 -m omni_bench.gpu_handoff --compare --requests 200 --warmup 20 \
  --rounds 2 --sizes-mib 1,64
TAIL=60 step profile 90 python3 -m omni_bench.gpu_handoff --profile --requests 200 --warmup 20 \
  --sizes-mib 1
# the crossing with a 1 ms hot spin against the path before: how much the wake-up costs
OMNI_RING_HOT_SPIN_US=1000 TAIL=8 step spin1ms 90 python3 -m omni_bench.gpu_handoff --compare \
  --requests 200 --warmup 20 --rounds 1 --sizes-mib 1
TAIL=40 step hparts "${HPARTS_S:-200}" python3 tools/device/higgs_parts.py --checkpoint \
  /tmp/higgs-full --out /tmp/higgs-parts ${HPARTS_ARGS:-}
cp /tmp/higgs-parts/higgs_parts.md /tmp/higgs-parts/higgs_parts.json "$OUT/" 2>/dev/null
HTESTS=${HTESTS:-tests/audio/test_higgs_windows.py tests/engine/test_higgs_audio.py}
TAIL=12 step htests "${HTESTS_S:-150}" python3 -m pytest -q -p no:cacheprovider -rs $HTESTS
TAIL=16 step higgs "${HIGGS_S:-420}" python3 -m omni_bench.higgs_serve --checkpoint /tmp/higgs-full \
  --gpu --out /tmp/higgs-serve ${HIGGS_ARGS:-}
cp /tmp/higgs-serve/higgs_serve.md /tmp/higgs-serve/higgs_serve.json "$OUT/" 2>/dev/null
# the same bench on $BEFORE's server and example repository (this tree's bench and transport)
BEFORE=${BEFORE:-$PWD/../..}
TAIL=16 PYTHONPATH=$BEFORE/server:${PYTHONPATH#*/server:} step higgsbefore "${HIGGS_S:-420}" \
  python3 -m omni_bench.higgs_serve --checkpoint /tmp/higgs-full --gpu \
  --repo "$BEFORE/examples/higgs-audio-v2" --out /tmp/higgs-before ${HIGGS_BEFORE_ARGS:-}
cp /tmp/higgs-before/higgs_serve.md "$OUT/higgs_before.md" 2>/dev/null
step tier "${TIER_S:-300}" python3 -m pytest -q -p no:cacheprovider -m "gpu or gpu2" -rs \
  tests/transport/test_cuda_ipc.py tests/wire/test_cuda_ipc.py tests/engine/test_cuda_graphs.py \
  tests/engine/test_paged_decode.py tests/engine/test_memory_gpu.py tests/gpu/test_oom.py \
  tests/gpu/test_gpu_start.py tests/gpu/test_mps.py tests/gpu/test_weight_share_gpu.py
BEFORE_PY="PYTHONPATH=$BEFORE_TREE/server:$BEFORE_TREE/tools:$BEFORE_TREE/clients:$BEFORE_TREE/transport_ext:/tmp/site"
PARTS="env $BEFORE_PY python3 tools/device/crossing_parts.py --label before"
PARTS="$PARTS && python3 tools/device/crossing_parts.py --label after"
TAIL=50 step parts 90 bash -c "$PARTS && $PARTS"
TAIL=14 step ab "${AB_S:-200}" python3 tools/device/crossing_ab.py --variant "before=$BEFORE_TREE" \
  --variant "after=$PWD" --variant "after, no hot poll=$PWD:OMNI_RING_HOT_SPIN_US=0" \
  --variant "after, 1 ms poll=$PWD:OMNI_RING_HOT_SPIN_US=1000" --rounds 2 --sizes-mib "${AB_MIB:-1,64}"
TAIL=16 step abpoll "${AB_S:-200}" python3 tools/device/crossing_ab.py \
  --variant "before=$BEFORE_TREE" --variant "after=$PWD" \
  --variant "after, fixed 200 us poll=$PWD:OMNI_RING_HOT_SPIN_US=200" --rounds 2 \
  --sizes-mib "${AB_MIB:-1,64}"
TAIL=12 step cpu "${CPU_S:-60}" python3 tools/device/ring_cpu_cost.py --variant "before=$BEFORE_TREE" \
  --variant "after=$PWD" --gaps-us 10000,2000,500,200 --seconds "${CPU_SECONDS:-0.7}" --rounds 2
TAIL=80 step gemv "${GEMV_S:-200}" python3 tools/device/gemv_bench.py --json "$OUT/gemv.json"
TAIL=20 step engine "${ENGINE_S:-200}" python3 -m pytest -q -p no:cacheprovider -m gpu -rs \
  tests/engine/test_cuda_graphs.py tests/engine/test_paged_decode.py \
  tests/engine/test_memory_gpu.py tests/engine/test_higgs_audio.py \
  tests/engine/test_overlap.py tests/engine/test_gemv.py
STEP_ARGS=${STEP_ARGS:---shapes smollm2-135m,llama-1b,llama-3b --batches 1,64 --profile}
TAIL=200 PYTHONPATH=$BEFORE/server:$PWD/tools:${PYTHONPATH#*transport_ext:} step stepbefore \
  "${STEP_S:-240}" python3 -m omni_bench.gpu_step $STEP_ARGS --attention paged --ttft "" \
  --host-profile --json "$OUT/stepbefore.json"
TAIL=200 step step "${STEP_S:-240}" python3 -m omni_bench.gpu_step $STEP_ARGS --host-profile \
  --json "$OUT/step.json"
TAIL=40 step codec "${CODEC_S:-240}" python3 tools/device/higgs_tokenizer_check.py \
  --out /tmp/higgs-tokenizer-check
TAIL=60 step qwen "${QWEN_S:-240}" bash -c "python3 -m pytest -q -p no:cacheprovider -rs \
  tests/models/qwen3_omni/test_moe_triton.py tests/models/qwen3_omni/test_gpu.py \
  && python3 -m omni_bench.gpu_moe --sweep"
TAIL=40 step first "${FIRST_S:-240}" bash tools/device/first_gpu_run.sh
echo "left: $(ls /dev/shm | grep -c '^omni-') /dev/shm segments, $(pgrep -fc omni_server) servers"

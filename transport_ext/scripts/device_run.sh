#!/usr/bin/env bash
# One call on a GPU machine (the lent H200): build the library with CMake, run the transport
# tests (CUDA ones included), then the CUDA crossing and CPU benchmarks, and the spin under
# contention (on every core, and on two). Writes under $OUT when
# set. Needs python3 with torch (CUDA build), numpy, cffi, pyzmq, pytest on the path.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/omni-transport-out}
mkdir -p "$OUT"
nvidia-smi -L || true
echo "cores: $(nproc)  kernel: $(uname -r)"
cmake -S . -B build/device -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build/device -j 8 2>&1 | grep -E "warning|error|Built target"
export PYTHONPATH=$PWD/transport_ext:$PWD/tools${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 -c "import omni_transport, torch; print('abi', omni_transport.abi_version(), 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"
python3 -m pytest -p no:cacheprovider -q -rs ${TESTS:-tests/transport} 2>&1 | tee "$OUT/pytest.log" \
  | tail -25 || true
python3 -m omni_bench.transport --cuda --cuda-iterations 500 --markdown "$OUT/cuda.md" 2>&1 | tail -12
python3 -m omni_bench.transport --runs ${RUNS:-3} --markdown "$OUT/cpu.md" 2>&1 | tail -40
# the spin under contention, both ways (docs/transport.md): on every core, then confined to two
# (a quiet 2-core machine with one core kept busy: the benchmark's processes inherit the mask)
python3 -m omni_bench.transport --contention --runs ${RUNS:-3} --markdown "$OUT/contention.md" \
  2>&1 | tail -22
taskset -c 0,1 python3 -m omni_bench.transport --contention --runs ${RUNS:-3} \
  --markdown "$OUT/contention-2cores.md" 2>&1 | tail -22
ls /dev/shm | grep -c '^omni-' || true
ls /tmp | grep -c 'omni-bench' || true  # socket files left behind (expect 0)

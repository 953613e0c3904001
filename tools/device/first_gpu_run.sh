#!/usr/bin/env bash
# The README's "With a GPU" commands on the H200 (a source checkout: the machine has its own
# CUDA torch and no network, so `pip install` is replaced by PYTHONPATH, docs/gpu.md): a tiny
# random checkpoint, the topology the example chooses with no override, the example served,
# one greedy speech request; then the GPU placement test. Run by h200_run.sh's `first` step.
set -uo pipefail
cd "$(dirname "$0")/../.."
python3 -m omni_bench.random_checkpoint higgs-audio-v2 --size tiny --out /tmp/higgs-first || exit 1
python3 -m omni_server config resolve --repo examples/higgs-audio-v2 --show topology \
  --parameters.checkpoint /tmp/higgs-first | tail -n 12
log=/tmp/first-server.log
python3 -m omni_server --repo examples/higgs-audio-v2 --parameters.checkpoint /tmp/higgs-first \
  --port 8123 > "$log" 2>&1 &
server=$!
for _ in $(seq 180); do
  grep -q "omni-server ready" "$log" && break
  kill -0 $server 2>/dev/null || break
  sleep 1
done
grep -E "ready|captured|MPS|cuda|ERROR" "$log" | head -n 12
curl -sf -o /tmp/first.wav -w "speech: HTTP %{http_code}, %{size_download} bytes, %{time_total} s\n" \
  -H 'Content-Type: application/json' \
  -d '{"model": "higgs-audio-v2", "input": "The sun rises in the east.", "voice": "joe", "response_format": "wav"}' \
  http://127.0.0.1:8123/v1/audio/speech
status=$?
kill -TERM $server; wait $server
echo "server exit $? (SIGTERM); speech rc=$status"
python3 -m pytest -q -p no:cacheprovider -rs tests/examples/test_higgs_gpu_placement.py

#!/usr/bin/env bash
# The seed's deployment on one machine (see README.md here): a tiny DeepSeek V4 of V4-Flash's
# layer pattern served by a prefill and a decode instance, each -dp 2 -tp 2 with wide expert
# parallelism, sequence parallelism, DSA context parallelism, EPLB, MTP k = 3 and the int8 (C8)
# cache, joined by the TCP KV connector behind lane proxy; then lane bench through the proxy
# (and AISBench where installed), one 3.5K-token request traced (all 57 steps), and the
# deployment's greedy output checked against one rank of one instance.
#
#   bash examples/seed_shape/run.sh [OUT_DIR]      (default: ./seed_shape_run)
#
# Environment: DP (2), TP (2), PROMPT_TOKENS (3500), CHUNKS (4), NUM_PROMPTS (8), BASE_PORT (8600).
set -euo pipefail
OUT=$(mkdir -p "${1:-seed_shape_run}" && cd "${1:-seed_shape_run}" && pwd)
DP=${DP:-2}; TP=${TP:-2}; PROMPT_TOKENS=${PROMPT_TOKENS:-3500}; CHUNKS=${CHUNKS:-4}
NUM_PROMPTS=${NUM_PROMPTS:-8}; PORT=${BASE_PORT:-8600}
PROXY=$PORT; PREFILL=$((PORT + 1)); DECODE=$((PORT + 2)); KV_P=$((PORT + 10)); KV_D=$((PORT + 30))
MODEL="$OUT/model"
# the ranks of an instance authenticate each other, and the KV side channel, with this secret
export LANE_RPC_SECRET=${LANE_RPC_SECRET:-$(python -c "import secrets; print(secrets.token_hex(16))")}

PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

step() { echo; echo "== $*"; }

step "1. a tiny DeepSeek V4 of V4-Flash's layer pattern (2 SWA, then CSA / HCA alternating, HCA rate 128)"
[ -f "$MODEL/config.json" ] || lane tiny-model deepseek_v4 "$MODEL" --seed-shape
lane explain "$MODEL" --tensor-parallel-size "$TP" --data-parallel-size "$DP" --enable-expert-parallel --enable-eplb --kv-cache-dtype int8 \
  | tee "$OUT/explain.txt" | head -n 12

# a prompt of PROMPT_TOKENS tokens is CHUNKS prefill chunks under this budget (+ room for drafts)
BUDGET=$(( (PROMPT_TOKENS + CHUNKS - 1) / CHUNKS ))
COMMON=(--model "$MODEL" --served-model-name seed --dtype float32
        -dp "$DP" -tp "$TP" --enable-expert-parallel --enable-sequence-parallel --enable-dsa-cp
        --enable-eplb --eplb-config '{"step_interval": 8, "window_size": 8, "log_balancedness": true}'
        --speculative-config '{"method": "mtp", "num_speculative_tokens": 3}'
        --kv-cache-dtype int8 --max-num-batched-tokens "$BUDGET" --kv-cache-memory-bytes 512M
        --max-model-len 8192 --trace)

step "2. prefill instance :$PREFILL and decode instance :$DECODE (each DP $DP x TP $TP), lane proxy :$PROXY"
lane serve "${COMMON[@]}" --port "$PREFILL" \
  --kv-transfer-config "{\"kv_connector\": \"TcpConnector\", \"kv_role\": \"kv_producer\", \"kv_port\": $KV_P}" \
  > "$OUT/prefill.log" 2>&1 & PIDS+=($!)
lane serve "${COMMON[@]}" --port "$DECODE" \
  --kv-transfer-config "{\"kv_connector\": \"TcpConnector\", \"kv_role\": \"kv_consumer\", \"kv_port\": $KV_D}" \
  > "$OUT/decode.log" 2>&1 & PIDS+=($!)
lane proxy --port "$PROXY" --prefiller-ports "$PREFILL" --decoder-ports "$DECODE" --health-interval 0.25 \
  > "$OUT/proxy.log" 2>&1 & PIDS+=($!)
for port in "$PREFILL" "$DECODE" "$PROXY"; do
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$port/health" > /dev/null && break
    for p in "${PIDS[@]}"; do kill -0 "$p" 2>/dev/null || { echo "a server died: see $OUT/*.log"; exit 1; }; done
    sleep 1
  done
done
echo "all up"

step "3. lane bench through the proxy: random $PROMPT_TOKENS in / 64 out, $NUM_PROMPTS prompts, 2 at a time"
lane bench --base-url "http://127.0.0.1:$PROXY" --model seed --tokenizer "$MODEL" --dataset-name random \
  --random-input-len "$PROMPT_TOKENS" --random-output-len 64 --num-prompts "$NUM_PROMPTS" --max-concurrency 2 \
  --ignore-eos --save-result --result-dir "$OUT" --result-filename bench.json \
  | grep -E "Successful|Failed|Benchmark duration|throughput|Mean TTFT|Mean TPOT|acceptance|results:"
if command -v ais_bench > /dev/null; then
  # AISBench reads model tasks from its configs/models: one more there, aimed at the proxy
  step "3b. AISBench ($(command -v ais_bench)) through the proxy: --datasets ${AISBENCH_DATASETS:=synthetic_gen}"
  python - "$PROXY" "$MODEL" <<'PY'
import os, sys
import ais_bench.benchmark.configs.models.vllm_api as d
with open(os.path.join(os.path.dirname(d.__file__), "lane_seed_proxy.py"), "w") as f:
    f.write(f"""from ais_bench.benchmark.models import VLLMCustomAPIChat
models = [dict(attr="service", type=VLLMCustomAPIChat, abbr="lane-seed-proxy", path={sys.argv[2]!r}, model="seed",
               stream=True, request_rate=0, retry=2, api_key="", host_ip="127.0.0.1", host_port={sys.argv[1]},
               url="", max_out_len=64, batch_size=2, trust_remote_code=False,
               generation_kwargs=dict(temperature=0, ignore_eos=True))]
""")
PY
  (cd "$OUT" && ais_bench --models lane_seed_proxy --datasets "$AISBENCH_DATASETS" --mode perf \
     --summarizer default_perf --spec-decode | tail -n 40) || echo "AISBench failed (see its output above)"
else
  echo "(AISBench not installed: pip install ais_bench_benchmark, and this step runs it through the proxy too)"
fi

step "4. one $PROMPT_TOKENS-token request traced through the proxy, /metrics scraped while it runs"
python - "$MODEL" "$PROMPT_TOKENS" > "$OUT/prompt.txt" <<'PY'
import random, sys
from transformers import AutoTokenizer
tok, n = AutoTokenizer.from_pretrained(sys.argv[1]), int(sys.argv[2])
words = [w for w in tok.get_vocab() if w.isalpha() and len(w) > 3]
random.seed(0)
text, special = "", len(tok("a")["input_ids"]) - len(tok("a", add_special_tokens=False)["input_ids"])
while len(tok(text, add_special_tokens=False)["input_ids"]) < n:
    text += " ".join(random.choice(words) for _ in range(64)) + " "
print(tok.decode(tok(text, add_special_tokens=False)["input_ids"][:n - special]), end="")  # n with BOS
PY
lane trace --base-url "http://127.0.0.1:$PROXY" --prompt-file "$OUT/prompt.txt" --max-tokens 32 \
  --output-dir "$OUT" > "$OUT/trace.txt" 2>&1 & TRACE=$!
while kill -0 "$TRACE" 2>/dev/null; do  # step 56: the scrapes a monitoring system makes
  for port in "$PREFILL" "$DECODE" "$PROXY"; do curl -s "http://127.0.0.1:$port/metrics" > /dev/null || true; done
  sleep 0.2
done
wait "$TRACE" || { cat "$OUT/trace.txt"; exit 1; }
cat "$OUT/trace.txt"
for port in "$PREFILL" "$DECODE"; do curl -s "http://127.0.0.1:$port/metrics" > "$OUT/metrics_$port.txt"; done
grep -h -E '^(vllm:eplb_rebalance_events_total|lane:kv_transfer_bytes_total|vllm:spec_decode_num_(draft|accepted)_tokens_total)' \
  "$OUT"/metrics_*.txt || true

step "5. greedy output through the deployment against one rank of one instance (int8 cache, MTP k = 3)"
python "$(dirname "$0")/check_output.py" "http://127.0.0.1:$PROXY" "$MODEL" "$OUT/prompt.txt"
echo
echo "trace: $OUT/trace.html (open it in a browser), $OUT/trace.json (Perfetto); logs in $OUT"

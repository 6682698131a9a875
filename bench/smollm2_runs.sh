#!/usr/bin/env bash
# SmolLM2-135M-Instruct learning runs on the GPU machine, in the background across device calls
# (one call runs at most 10 minutes; a run started with setsid lives on while the machine stays
# warm, ~30 s between calls). Needs $HOME/smollm2/hf (bench/smollm2_to_gpu.sh gpu) and the
# wheels of .gguf_parts/whl installed in /tmp/site (the same script does it).
#   bash bench/smollm2_runs.sh start NAME [overrides...]   NAME: grpo | ppo | gsm8k, or a
#                                                           variant of one: grpo_lr1e5 ...
#   bash bench/smollm2_runs.sh wait SECONDS                 sleep while any run is alive, then
#                                                           report; copies metrics/logs to $OUT
#   bash bench/smollm2_runs.sh check NAME                   the last checkpoint loads in
#                                                           transformers and generates
#   bash bench/smollm2_runs.sh stop NAME                    ends a run (e.g. at a time budget)
# Several runs may share the GPU (session 11 ran all three at once: bench/RESULTS.md).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 HYBRIDENGINE_NO_PROGRESS=1
RUNS="${HOME:-/root}/runs"
mkdir -p "$RUNS"

config() { case ${1%%_*} in     # grpo_lr1e5 etc.: a variant of grpo (its own name and directory)
  grpo) echo configs/arith_smollm2.yaml ;;
  ppo) echo configs/arith_smollm2_ppo.yaml ;;
  gsm8k) echo configs/gsm8k_smollm2.yaml ;;
  *) echo "unknown run $1 (grpo | ppo | gsm8k)" >&2; exit 2 ;;
esac; }

data() {
  [ -f data/processed/arith/train.parquet ] || python3 tools/data/arith.py --local_dir data/processed/arith
  if [ "$1" = gsm8k ] && [ ! -f data/processed/gsm8k/train.parquet ]; then
    python3 tools/data/gsm8k.py --input_dir .benchdata/gsm8k --local_dir data/processed/gsm8k
  fi
}

start() {
  local name=$1; shift
  local cfg; cfg=$(config "$name") || exit 2
  data "${name%%_*}"
  date +%s > "$RUNS/$name.start"
  setsid nohup torchrun --nproc_per_node=1 --master_port $((29500 + RANDOM % 1000)) \
    launch/ppo.py --config "$cfg" trainer.default_local_dir="$RUNS/$name" "$@" \
    > "$RUNS/$name.log" 2>&1 < /dev/null &
  echo "started $name (pid $!): $cfg $*"
}

report() {
  for log in "$RUNS"/*.log; do
    [ -f "$log" ] || continue
    local name; name=$(basename "$log" .log)
    echo "== $name: $(grep -c '"step"' "$RUNS/$name/metrics.jsonl" 2>/dev/null) records, started" \
         "$(( $(date +%s) - $(cat "$RUNS/$name.start") )) s ago"
    grep -E "error|Traceback|val/" "$log" | tail -3
    tail -c 400 "$log"; echo
    if [ -n "${OUT:-}" ]; then
      cp "$log" "$OUT/$name.log"
      [ -f "$RUNS/$name/metrics.jsonl" ] && cp "$RUNS/$name/metrics.jsonl" "$OUT/$name.metrics.jsonl"
    fi
  done
  nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
}

wait_runs() {
  local until=$(( $(date +%s) + $1 ))
  while [ "$(date +%s)" -lt "$until" ] && pgrep -f "launch/ppo.py" > /dev/null; do sleep 5; done
  report
}

check() {
  local root="$RUNS/$1" step
  step=$(cat "$root/latest_checkpointed_iteration.txt")
  python3 - "$root/global_step_$step/actor" <<'EOF'
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
path = sys.argv[1]
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
tok = AutoTokenizer.from_pretrained(path)
msgs = [{"role": "user", "content": "What is 47 + 38? Answer with just the number."}]
ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt")
ids = (ids["input_ids"] if hasattr(ids, "keys") else ids).cuda()
out = model.generate(ids, max_new_tokens=16, do_sample=False)
print(f"loaded {path} with AutoModelForCausalLM: {sum(p.numel() for p in model.parameters())} "
      f"parameters; greedy answer to 47 + 38: {tok.decode(out[0, ids.shape[1]:])!r}")
EOF
}

stop() {
  # matches the run's own command line only (not the shell that asks: its line lacks the key)
  pkill -f -- "trainer.default_local_dir=$RUNS/$1( |\$)" && echo "stopped $1" || echo "$1 is not running"
}

case "${1:-}" in
  start) shift; start "$@" ;;
  stop) stop "$2" ;;
  wait) wait_runs "${2:-540}" ;;
  check) check "$2" ;;
  *) echo "usage: see the top of bench/smollm2_runs.sh" >&2; exit 2 ;;
esac

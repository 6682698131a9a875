#!/usr/bin/env bash
# One batched GPU session (run through the device tool on an nvidia-h200-x2 machine from the
# repo root): GPU tests, then every benchmark, each writing JSON (and logs); at the end
# $OUT holds session.log and results.tgz (all of them: the device tool returns 8 files at most).
# One device call runs at most 10 minutes: split the parts over calls (ppo alone takes ~10).
# Usage: OUT=/some/dir bash bench/gpu_session.sh [part ...]
#   parts: realtext paged paged_ppo freecache wgradprobe flag_ab ppo_ab graph_ab group_ab trl issue27 tests model models models_ppo train rollout rollout_mixed tuned probe probe_quick gemmprobe swigluprobe smallgemm smallchain pagedprobe attnprobe timeline code reshard kernels ppo models steady steady2 megatron families_rollout families_ppo (families: both) moe longseq; ONLY="ppo_seed grpo_fixed"
#   keeps only the named runs of those parts
# CACHE_OFF=1: no compile cache carried in (a cold compile's time measured)
# ppo needs omegaconf (a wheel in .whl/, installed with --target /tmp/site) and, carried in
# .benchdata/ (git-ignored), the Qwen2.5 tokenizer (tok/) and GSM8K train prompts (train.jsonl);
# steady and steady2 also the GSM8K test prompts (test.jsonl). bench/prepare_carry.sh makes both.
set -u
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 HYBRIDENGINE_NO_PROGRESS=1
ls .whl/*.whl > /dev/null 2>&1 && pip install -q --no-deps --target /tmp/site .whl/*.whl
OUT=${OUT:-/tmp/out}; RES=/tmp/gpu_results; mkdir -p "$OUT" "$RES"
# Compilation is most of a short benchmark's time (the rollout's 130-170 s warm-up at 0.5B):
# inductor's and Triton's caches live in one folder that a call brings back, compressed in parts
# of 15 MB ($OUT/compile_cache.txz.part-aa, -ab, ...: a returned file has at most 16 MiB; in
# all what a call's 64 MiB leave beside the tree: pack_cache), and a later call, another
# machine of the same image, may carry in as .compile_cache/compile_cache.{txz,tgz}.part-*.
# xz where the machine has it: session 37's cache, 174 MB unpacked, is 34.5 MB gzipped and
# 10.6 MB as xz -6 (compiled .so files and cubins repeat a lot), so it fits beside the tree again.
# Measured: GRPO 1.5B's first step compiled in 201 s cold, 78 s with the cache.
# (not $CC: that is the C compiler's variable, which Triton reads)
# The log-prob CUDA extension (csrc/, JIT-built by torch at its first use) goes there too: session
# 27 saw step 1's old-log-prob phase take 48-69 s with inductor's cache warm (the update phases'
# compilation 1.7 s); tools/bench_ppo.py now times the extension's load and lists step 1's
# compilations, to tell which it is.
COMPILE_CACHE=/tmp/compile_cache; export TORCHINDUCTOR_CACHE_DIR=$COMPILE_CACHE/inductor TRITON_CACHE_DIR=$COMPILE_CACHE/triton \
  TORCH_EXTENSIONS_DIR=$COMPILE_CACHE/torch_extensions
unpack_cache() { local kind=$1 unzip=$2
                 ls .compile_cache/compile_cache.$kind.part-* > /dev/null 2>&1 || return 1
                 mkdir -p "$COMPILE_CACHE" && cat .compile_cache/compile_cache.$kind.part-* | $unzip | tar -x -C "$COMPILE_CACHE" && \
                   echo "compile cache ($kind): $(du -sh "$COMPILE_CACHE")" >> "$RES/session.log"; }
[ -z "${CACHE_OFF:-}" ] && [ ! -d "$COMPILE_CACHE" ] && { unpack_cache txz "xz -d -T0" || unpack_cache tgz "gzip -d"; }
# Pack after every run too, so a call killed at its time limit still returns what finished.
pack() { tar -czf "$OUT/results.tgz" -C "$RES" . && cp "$RES/session.log" "$OUT/"; }
# The cache comes back only if a later call can carry it beside this tree (its 64 MiB hold the
# tree, .benchdata, .whl and the cache: session 31's 38.7 MB gzipped cache could not go back in).
pack_cache() { [ -d "$COMPILE_CACHE" ] || return 0; local kind=tgz zip="gzip -6"
               command -v xz > /dev/null && kind=txz zip="xz -6 -T0"
               tar -c -C "$COMPILE_CACHE" . | $zip > /tmp/cc.$kind || return 0
               rest=$(du -sb --exclude=./.compile_cache --exclude=./.before --exclude=./.git --exclude=./checkpoints --exclude=__pycache__ . | cut -f1)
               room=$((67108864 - rest - 2000000))
               if [ "$(stat -c %s /tmp/cc.$kind)" -lt "$room" ]; then rm -f "$OUT"/compile_cache.t?z*
                 split -b 15000000 /tmp/cc.$kind "$OUT/compile_cache.$kind.part-"
               else echo "compile cache not returned: $(stat -c %s /tmp/cc.$kind) bytes ($kind), room for $room beside the tree" >> "$RES/session.log"; fi; }
trap 'pack_cache; pack' EXIT
parts=${*:-tests model train rollout reshard kernels ppo megatron}
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
run() { local name=$1; shift
        if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" ${name%"${TAG:-}"} "* ]]; then return; fi
        echo "== $name: $*" | tee -a "$RES/session.log";
        timeout "${T:-300}" "$@" > "$RES/$name.json" 2> "$RES/$name.err";
        echo "rc=$? $(tail -c 600 "$RES/$name.json")" | tee -a "$RES/session.log"; pack; }
# the rollout benchmark with HF generate in the same run (HF=none leaves it out: its figure is
# needed only for the speedup) and $VARIANTS, else the variants given
rollout() { local hf=--hf; [ "${HF:-}" = none ] && hf=
            run rollout python3 tools/bench_rollout.py --compile --compile-prefill $hf --profile --variants "${VARIANTS-$1}" --out "$RES/rollout.partial.json"; }
for p in $parts; do case $p in
  tests)   # TESTS: a subset of the GPU tests (default: all of them)
           timeout "${T:-300}" python3 -m pytest -q -m gpu --durations=15 ${TESTS:-tests/} > "$RES/tests.log" 2>&1
           echo "rc=$?" >> "$RES/tests.log"; tail -25 "$RES/tests.log" | tee -a "$RES/session.log"; pack ;;
  model)   run model_hf python3 tools/bench_model.py --iters 10 --hf
           run model_compile python3 tools/bench_model.py --iters 10 --compile --profile ;;
  train)   run train_111 torchrun --nproc_per_node=1 tools/bench_train.py
           if [ "$ngpu" -ge 2 ]; then
             run train_211 torchrun --nproc_per_node=2 tools/bench_train.py --tp 2
             run train_121 torchrun --nproc_per_node=2 tools/bench_train.py --pp 2
             run train_112 torchrun --nproc_per_node=2 tools/bench_train.py
           fi ;;
  rollout) rollout no_pdl ;;
  tuned)   # the decode attention's launch settings swept, the fastest one as a rollout variant
           run probe python3 bench/probes/decode_step.py --attention-only
           export DECODE_LAUNCH=$(python3 bench/probes/best_decode_launch.py "$RES/probe.json")
           echo "DECODE_LAUNCH=$DECODE_LAUNCH" | tee -a "$RES/session.log"
           rollout decode_launch_env ;;
  rollout_mixed) # prompts of 256-512 tokens: the dense prefill pads (auto) against varlen
           run rollout_mixed python3 tools/bench_rollout.py --compile --compile-prefill --prompt-len-min 256 --variants prefill_varlen ;;
  attnprobe) run prefill_attention python3 bench/probes/prefill_attention.py ;;
  timeline) run timeline python3 bench/probes/timeline.py ;;
  code)    # inductor's generated code of the compiled prefill and decode step (gzipped)
           TORCH_LOGS=output_code timeout 300 python3 tools/bench_rollout.py --batch 64 --new-tokens 4 \
             --compile --compile-prefill > /dev/null 2> "$RES/output_code.log"
           echo "code rc=$?" | tee -a "$RES/session.log"; gzip -f "$RES/output_code.log"; pack ;;
  probe_quick) run probe python3 bench/probes/decode_step.py --attention-only ;;
  gemmprobe) run gemm_forms python3 bench/probes/gemm_forms.py ;;
  swigluprobe) run swiglu_down python3 bench/probes/swiglu_down.py ;;
  smallgemm) run small_gemm python3 bench/probes/small_gemm.py ;;
  wgradprobe) # issue 27: the weight-gradient products with and without gradient-accumulation
           # fusion, device and host time (bench/probes/wgrad_accumulation.py)
           run wgrad_probe python3 bench/probes/wgrad_accumulation.py ;;
  freecache) # what a trainer step's free_cache_engine costs the rollout: the cache allocated
           # and every decode graph the batch passes through captured again each generate
           # (spread lengths: every bucket), against an engine that keeps them
           run free_cache python3 tools/bench_rollout.py --compile --compile-prefill --response-lengths lognormal:96:0.8 --repeat 3 --variants free_cache ;;
  pagedprobe) # issue 25: the paged decode attention against the static one per layer, in CUDA
           # graphs (short, tail and 7B shapes; PROBE_PARTS: a subset of short,tail,7b)
           run paged_decode python3 bench/probes/paged_decode.py --parts "${PROBE_PARTS:-short,tail,7b}" ;;
  smallchain) # issue 25: the decode step's linear chain at small batch, inductor against fused
           # small-M Triton products (SMALL_ROWS: the batch sizes)
           run small_m_chain python3 bench/probes/small_m_chain.py --rows "${SMALL_ROWS:-4,8,16,32,64}" ;;
  probe)   run probe python3 bench/probes/decode_step.py
           ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
           [ -n "$ncu" ] && timeout 240 "$ncu" --clock-control none -k 'regex:_split_kernel|nvjet|splitK' -c 24 \
             --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
             --section Occupancy --section LaunchStats python3 bench/probes/decode_step.py --ncu \
             > "$RES/ncu.txt" 2>&1; echo "ncu rc=$?" | tee -a "$RES/session.log"; pack ;;
  reshard) if [ "$ngpu" -ge 2 ]; then
             run reshard torchrun --nproc_per_node=2 tools/bench_reshard.py --models 0.5b,7b --bucket-mb 64,256,1024 --profile
           fi ;;
  kernels) [ -f tools/bench_logprob.py ] && run logprob python3 tools/bench_logprob.py ;;
  megatron) run megatron python3 tools/bench_megatron.py ;;   # megatron-core wheel in .whl/
  steady)  # issue 30, one GPU: GRPO 64 prompts x 8 on GSM8K prompt lengths, 3 + 17 steps,
           # validation every 5: the CUDA defaults, then the same fast paths set by flags
           data="--tokenizer .benchdata/tok --gsm8k .benchdata/train.jsonl --gsm8k-test .benchdata/test.jsonl"
           grpo="--workload seed --algo grpo --warmup 3 --steps 17 --val-every 5 --set data.train_batch_size=64"
           T=${T:-580} run grpo_defaults python3 tools/bench_ppo.py $grpo --defaults $data
           T=${T:-580} run grpo_flags python3 tools/bench_ppo.py $grpo --train-compile --rollout-compile --max-tokens 8192 $data ;;
  steady2) # issue 30, two GPUs: the same run through torchrun, actor tp 2 -> rollout tp 1
           data="--tokenizer .benchdata/tok --gsm8k .benchdata/train.jsonl --gsm8k-test .benchdata/test.jsonl"
           python3 tools/bench_ppo.py --prepare /tmp/steady2 --workload seed --algo grpo --defaults --warmup 3 --steps 17 \
             --val-every 5 --set data.train_batch_size=64 --set actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2 $data
           eval "set -- $(cat /tmp/steady2/overrides.txt)"
           timeout "${T:-580}" torchrun --nproc_per_node=2 launch/ppo.py "$@" > "$RES/grpo_defaults_2gpu.log" 2>&1
           echo "torchrun rc=$?" | tee -a "$RES/session.log"
           run grpo_defaults_2gpu python3 tools/bench_ppo.py --summarize /tmp/steady2/out/metrics.jsonl --warmup 3 ;;
  models)  # issues 23 and 24, one GPU: the memory plan against the measured peak with the
           # defaults (offload=auto) at the Qwen2.5 shapes, then LoRA rank 64 (alpha 128) at 7B
           # and 0.5B beside 0.5B full parameters; GRPO, fixed 512 + 256 tokens
           data="--tokenizer .benchdata/tok --gsm8k .benchdata/train.jsonl"
           fixed="--workload fixed --algo grpo --defaults --warmup 1 --steps 2 $data"
           for m in ${MODELS:-1.5b 3b 7b}; do T=${T:-580} run "grpo_$m" python3 tools/bench_ppo.py $fixed --model "$m"; done
           T=${T:-580} run grpo_7b_lora64 python3 tools/bench_ppo.py $fixed --model 7b --lora 64
           # the plan's 7B LoRA peak is an 8,192-token micro-batch's activations (45.6 GiB of
           # 64.1): half the budget for issue 24's <= 60 GB
           T=${T:-580} run grpo_7b_lora64_4k python3 tools/bench_ppo.py $fixed --model 7b --lora 64 \
             --set actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096
           T=${T:-580} run grpo_0.5b_lora64 python3 tools/bench_ppo.py $fixed --model 0.5b --lora 64
           T=${T:-580} run grpo_0.5b python3 tools/bench_ppo.py $fixed --model 0.5b ;;
  models_ppo) # issue 23: PPO (actor + critic, GAE) with the defaults at the larger shapes, the
           # fixed 512 + 256 tokens, 256 prompts
           data="--tokenizer .benchdata/tok --gsm8k .benchdata/train.jsonl"
           for m in ${PPO_MODELS:-1.5b 3b}; do
             T=${T:-580} run "ppo_$m" python3 tools/bench_ppo.py --workload fixed --algo ppo --defaults \
               --warmup 1 --steps 2 --model "$m" $data
           done ;;
  ppo)     # PPO_STEPS: timed steps; PPO_PROFILE: the extra profiled step(s) (--profile,
           # --host-profile, or none); PPO_ARGS: more flags for ppo_seed and grpo_fixed, TAG: a
           # suffix for their names (a before/after in one call: TAG=_before PPO_ARGS="--set ...")
           data="--tokenizer .benchdata/tok --gsm8k .benchdata/train.jsonl"
           fast="--train-compile --rollout-compile --max-tokens 8192"
           how="--steps ${PPO_STEPS:-2} ${PPO_PROFILE---profile} ${PPO_ARGS:-}"
           T=${T:-600} run ppo_seed${TAG:-} python3 tools/bench_ppo.py --workload seed --algo ppo $fast $data $how
           T=${T:-600} run grpo_fixed${TAG:-} python3 tools/bench_ppo.py --workload fixed --algo grpo $fast $data $how
           T=${T:-600} run ppo_seed_offload python3 tools/bench_ppo.py --workload seed --algo ppo --steps 2 $fast $data --offload grads,optimizer
           T=${T:-600} run ppo_seed_recompute python3 tools/bench_ppo.py --workload seed --algo ppo --steps 2 --train-compile --rollout-compile --max-tokens 16384 $data --offload grads --set actor_rollout_ref.model.enable_gradient_checkpointing=true ;;
  group_ab) # issue 27: the training layers compiled in units of GROUP layers (default 24, the
           # whole 0.5B stack: HYBRIDENGINE_TRAIN_LAYER_GROUP, train.compile_layers) against one
           # layer a unit, the same tree, in GROUP_ORDER (a: grouped, b: per layer; default abba;
           # runs <run>_group<i> / <run>_layer<i>). The first grouped run compiles its larger
           # graphs cold (session 28: step 1 took 300 s with the rollout's cache warm, 2.6-3.2x a
           # per-layer step 1: give it T=440); PPO_STEPS timed steps, no profile. Session 28
           # measured no gain at GROUP=24 (bench/RESULTS.md): kept as an experiment switch.
           # First the grouped units' GPU test (graphs per grad mode, inductor + C++ wrapper)
           T=150 TESTS="tests/test_compile_bound.py -k grouped" bash "$0" tests
           order=${GROUP_ORDER:-abba}
           for (( i = 0; i < ${#order}; i++ )); do case ${order:i:1} in
             a) HYBRIDENGINE_TRAIN_LAYER_GROUP=${GROUP:-24} TAG=_group$((i + 1)) PPO_PROFILE= \
                  ONLY="${AB_RUNS:-ppo_seed}" bash "$0" ppo ;;
             b) TAG=_layer$((i + 1)) PPO_PROFILE= ONLY="${AB_RUNS:-ppo_seed}" bash "$0" ppo ;;
             *) echo "GROUP_ORDER: a (grouped) or b (per layer), not '${order:i:1}'" | tee -a "$RES/session.log" ;;
           esac; done ;;
  graph_ab) # issue 27: the training micro-batches' CUDA graphs (actor and critic
           # use_cuda_graph=true, train/cuda_graphs.py) against eager updates, the same tree, in
           # GRAPH_ORDER (a: graphs, b: eager; default abba; runs <run>_graphs<i> / <run>_eager<i>),
           # PPO_STEPS timed steps, no profile; first the graphs' GPU test (GRAPH_TEST=0 skips it)
           [ "${GRAPH_TEST:-1}" = 1 ] && T=${GRAPH_TEST_T:-240} TESTS="tests/test_cuda_graphs.py" bash "$0" tests
           order=${GRAPH_ORDER:-abba}
           for (( i = 0; i < ${#order}; i++ )); do case ${order:i:1} in
             a) TAG=_graphs$((i + 1)) PPO_PROFILE=${PPO_PROFILE-} ONLY="${AB_RUNS:-ppo_seed}" \
                  PPO_ARGS="--set actor_rollout_ref.actor.use_cuda_graph=true ${PPO_ARGS:-}" bash "$0" ppo ;;
             b) TAG=_eager$((i + 1)) PPO_PROFILE=${PPO_PROFILE-} ONLY="${AB_RUNS:-ppo_seed}" \
                  bash "$0" ppo ;;
             *) echo "GRAPH_ORDER: a (graphs) or b (eager), not '${order:i:1}'" | tee -a "$RES/session.log" ;;
           esac; done ;;
  flag_ab) # issue 27: one switch on (a) against the same tree without it (b) in one call: AB_SET
           # the key=value settings of (a) (each passed as --set), AB_NAME the runs' tag
           # (<run>_<AB_NAME><i> / <run>_base<i>), in AB_ORDER (default abba); PPO_STEPS timed
           # steps, no profile (PPO_PROFILE to add one). trainer.interleave_updates flips between
           # steps of one run instead (no second compile; drift falls on both sides): PPO_STEPS=8
           # PPO_PROFILE= PPO_ARGS=--alternate-interleave TAG=_alt ONLY=ppo_seed ... ppo; so do
           # --alternate-prefill-probe and --alternate-wgrad-fusion (tools/bench_ppo.py)
           sets=""; for kv in ${AB_SET:?AB_SET=key=value ...}; do sets="$sets --set $kv"; done
           order=${AB_ORDER:-abba}
           for (( i = 0; i < ${#order}; i++ )); do case ${order:i:1} in
             a) TAG=_${AB_NAME:-flag}$((i + 1)) PPO_PROFILE=${PPO_PROFILE-} ONLY="${AB_RUNS:-ppo_seed}" \
                  PPO_ARGS="$sets ${PPO_ARGS:-}" bash "$0" ppo ;;
             b) TAG=_base$((i + 1)) PPO_PROFILE=${PPO_PROFILE-} ONLY="${AB_RUNS:-ppo_seed}" \
                  bash "$0" ppo ;;
             *) echo "AB_ORDER: a (AB_SET) or b (without), not '${order:i:1}'" | tee -a "$RES/session.log" ;;
           esac; done ;;
  ppo_ab)  # issue 27's before/after in one call: the `ppo` runs named in AB_RUNS (default
           # ppo_seed) from .before/ (an earlier commit's code: BEFORE=REV bash
           # bench/prepare_carry.sh, carried as .before) and from this tree, in AB_ORDER (b:
           # before, a: this tree; default ba; runs named <run>_before<i> / <run>_after<i>, i the
           # position). A machine can drift within a call (session 24: a second run 14% slower in
           # phases neither commit touched): abba puts each version first once.
           # PPO_STEPS timed steps each, no profile (PPO_PROFILE to add one)
           for d in .benchdata .whl .compile_cache; do ln -sfn "../$d" ".before/$d"; done
           order=${AB_ORDER:-ba}
           for (( i = 0; i < ${#order}; i++ )); do case ${order:i:1} in
             b) (cd .before && TAG=_before$((i + 1)) PPO_PROFILE=${PPO_PROFILE-} \
                   ONLY="${AB_RUNS:-ppo_seed}" bash ../bench/gpu_session.sh ppo) ;;
             a) TAG=_after$((i + 1)) PPO_PROFILE=${PPO_PROFILE-} ONLY="${AB_RUNS:-ppo_seed}" \
                  bash bench/gpu_session.sh ppo ;;
             *) echo "AB_ORDER: b (before) or a (after), not '${order:i:1}'" | tee -a "$RES/session.log" ;;
           esac; done ;;
  paged)   # issue 25, one GPU: the paged KV layout against the static one (the `static`
           # variant, same process), compiled, CUDA graphs: the short benchmark (256 x 512 + 256),
           # GRPO-shaped (32 prompts x n 8: one prefill per prompt), long responses (lognormal,
           # mean 2,048, up to 16,384) at 0.5B, then the long workload at 7B paged alone
           # (PAGED_RUNS: a subset of short grpo long long_half tail tail_wide long7b; PAGED_VARIANTS: the short run's
           # variants, e.g. static,block64; PAGED_ARGS: more flags for every run, e.g. --profile)
           long="--new-tokens 16384 --response-lengths lognormal:2048:${PAGED_SIGMA:-0.8}"
           for r in ${PAGED_RUNS:-short grpo long long7b}; do case $r in
             short)  run paged_short python3 tools/bench_rollout.py --compile --compile-prefill --kv-layout paged --variants "${PAGED_VARIANTS:-static}" ${PAGED_ARGS:-} ;;
             grpo)   run paged_grpo python3 tools/bench_rollout.py --compile --compile-prefill --kv-layout paged --batch 32 --n 8 --variants static ${PAGED_ARGS:-} ;;
             long)   run paged_long python3 tools/bench_rollout.py --compile --compile-prefill --kv-layout paged $long --repeat 1 --variants static ${PAGED_ARGS:-} ;;
             tail)   # the long workload's tail alone: a few rows at long contexts, where the
                     # step's latency, not its batch, sets the time
                     run paged_tail python3 tools/bench_rollout.py --compile --compile-prefill --kv-layout paged --batch 8 --prompt-len 4096 --new-tokens 1024 --variants static ${PAGED_ARGS:-} ;;
             tail_wide) # the same rows in the long workload's tables (16,896 tokens wide): its
                     # tail as it runs there, where splitting each row's own keys counts
                     run paged_tail_wide python3 tools/bench_rollout.py --compile --compile-prefill --kv-layout paged --batch 8 --prompt-len 4096 --new-tokens 1024 --max-model-len 16896 --variants static ${PAGED_ARGS:-} ;;
             long_half) # the long workload in a cache of 128 rows of 16,896 tokens for its 256
                     # sequences, both layouts (static: continuous batching over 128 rows; paged:
                     # the same bytes in blocks): what kv_layout=auto decides between
                     run paged_long_half python3 tools/bench_rollout.py --compile --compile-prefill --kv-layout paged $long --repeat 1 --kv-cache-tokens $((129 * 16896)) --variants static ${PAGED_ARGS:-} ;;
             long7b) run paged_long_7b python3 tools/bench_rollout.py --model qwen2.5-7b --compile --compile-prefill --kv-layout paged $long --repeat 1 ;;
           esac; done ;;
  paged_ppo) # issue 25: the GRPO step (0.5B, 32 prompts x 8, defaults) with responses of up to
           # 4,096 tokens stopping at lognormal lengths (mean 1,024), the static KV layout
           # against the paged one (PAGED_SIGMA: the spread)
           data="--tokenizer .benchdata/tok --gsm8k .benchdata/train.jsonl"
           for layout in ${PAGED_LAYOUTS:-static paged}; do
             T=${T:-580} run "grpo_long_$layout" python3 tools/bench_ppo.py --workload fixed --algo grpo \
               --defaults --warmup 1 --steps 2 --response-lengths "lognormal:1024:${PAGED_SIGMA:-0.8}" \
               --set data.max_response_length=4096 --set actor_rollout_ref.rollout.kv_layout=$layout $data
           done ;;
  realtext) # real text that stops at EOS, on the GPU: the default job's pretrained stories260K
           # (models/stories260k) with GRPO, then PPO (critic, GAE, 4 mini-batches an update),
           # one process, responses of up to RT_LEN tokens (the model stops where it chooses);
           # RT_EXTRA: more overrides for both (e.g. actor_rollout_ref.rollout.kv_layout=paged),
           # RT_TAG: a suffix for their names, RT_ALGOS: a subset (e.g. grpo)
           rt="trainer.device=cuda actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1
               data.max_response_length=${RT_LEN:-448} trainer.total_training_steps=${RT_STEPS:-10}
               trainer.save_freq=-1 trainer.test_freq=5 ${RT_EXTRA:-}"
           ppo="algorithm.adv_estimator=gae actor_rollout_ref.rollout.n=1 data.train_batch_size=64
                actor_rollout_ref.actor.ppo_mini_batch_size=16 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8
                critic.optim.lr=1e-3 critic.ppo_micro_batch_size_per_gpu=8"
           for algo in ${RT_ALGOS:-grpo ppo}; do
             extra=; [ $algo = ppo ] && extra=$ppo; name=realtext_$algo${RT_TAG:-}
             timeout "${T:-200}" torchrun --nproc_per_node=1 launch/ppo.py $rt $extra \
               trainer.default_local_dir=/tmp/$name > "$RES/$name.log" 2>&1
             echo "$name rc=$?" | tee -a "$RES/session.log"; tail -4 "$RES/$name.log" >> "$RES/session.log"
             cp /tmp/$name/metrics.jsonl "$RES/$name.metrics.jsonl" 2>/dev/null; pack
           done ;;
  trl)     # issue 27's peer in the same call: TRL's GRPOTrainer (HF generate) at the fixed
           # workload's shape, 3 steps (../shared/bench/hf_trl_baseline.py copied to .benchdata/;
           # trl, datasets, dill, multiprocess wheels in .whl/)
           T=${T:-300} run trl_grpo env ONLY_TRL=1 OUT="$RES" python3 .benchdata/hf_trl_baseline.py ;;
  issue27) # issue 27's 0.5B figures in one call, the cold compile allowed for (a fresh checkout
           # carries no compile cache: GRPO fixed's first step ~160 s, PPO seed's ~150 s): GRPO
           # fixed, TRL's GRPOTrainer beside it (the >= 8x check), the PPO seed step; ~470 s
           # cold. The 1.5B step (~250 s cold) wants a call of its own:
           # ONLY=grpo_fixed TAG=_1.5b PPO_STEPS=2 PPO_PROFILE= PPO_ARGS="--model 1.5b" T=330 ... ppo
           ONLY=grpo_fixed PPO_STEPS=3 PPO_PROFILE= T=${T:-300} bash "$0" ppo
           T=${T:-210} bash "$0" trl
           ONLY=ppo_seed PPO_STEPS=3 PPO_PROFILE= T=${T:-300} bash "$0" ppo ;;
  moe)     # issue 29, one GPU: the Qwen3-MoE-style 1B (64 experts, top 8) beside the dense model
           # of its active width, rollout and GRPO (fixed 512 + 256 tokens, defaults)
           data="--tokenizer .benchdata/tok --gsm8k .benchdata/train.jsonl"
           for m in qwen3-dense-active qwen3-moe-1b; do
             run "rollout_$m" python3 tools/bench_rollout.py --model "$m" --compile --compile-prefill
             T=${T:-580} run "grpo_$m" python3 tools/bench_ppo.py --workload fixed --algo grpo --defaults --steps 2 --model "$m" --profile $data
           done ;;
  longseq) # issue 28, one GPU: one actor update on single sequences of 8k, 16k and 32k tokens,
           # recomputation on, at 0.5B and 1.5B (where one GPU stops: an OOM prints {"oom": true})
           for m in ${LONGSEQ_MODELS:-0.5b 1.5b}; do for n in ${LONGSEQ_LENS:-8192 16384 32768}; do
             T=${T:-200} run "longseq_${m}_$n" python3 tools/bench_train.py --model "$m" --seq-len "$n" \
               --num-mb 1 --iters 3 --recompute
           done; done ;;
  families|families_rollout|families_ppo)
           # issue 26, one GPU: the Qwen3-0.6B, Qwen3-1.7B and Gemma-2-2B shapes beside Qwen2.5-0.5B
           # in the same session, the same flags for each (FAMILY_MODELS: a subset). Rollout:
           # compiled decode step and prefill (FAMILY_ROLLOUT_ARGS: another workload, e.g. short
           # contexts where the weights, not the KV cache, bound the decode step; FAMILY_TAG: a
           # suffix for those runs' names; FAMILY_ROLLOUT_COMPILE= : CUDA graphs without inductor);
           # GRPO: 2 steps of fixed 512 + 256 tokens, defaults (FAMILY_PPO_FLAGS: other flags, e.g.
           # empty: eager training layers, CUDA graphs without inductor in the rollout)
           fam=${FAMILY_MODELS:-qwen3-0.6b qwen3-1.7b gemma2-2b}
           if [ "$p" != families_ppo ]; then
             for m in qwen2.5-0.5b $fam; do
               run "rollout_$m${FAMILY_TAG:-}" python3 tools/bench_rollout.py --model "$m" ${FAMILY_ROLLOUT_COMPILE---compile --compile-prefill} ${FAMILY_ROLLOUT_ARGS:-}
             done
           fi
           if [ "$p" != families_rollout ]; then
             data="--tokenizer .benchdata/tok --gsm8k .benchdata/train.jsonl"
             for m in 0.5b $fam; do
               T=${T:-580} run "grpo_family_$m${FAMILY_TAG:-}" python3 tools/bench_ppo.py --workload fixed --algo grpo ${FAMILY_PPO_FLAGS---defaults} --steps 2 --model "$m" $data
             done
           fi ;;
esac; done

#!/usr/bin/env bash
# Builds, on the CPU machine, the git-ignored folders a GPU session carries into the device tool
# (carry: [".whl", ".benchdata", ".compile_cache"]); a fresh session's checkout has none of them.
#   .benchdata/  the Qwen2.5 tokenizer (tok/), GSM8K train and test prompts, TRL's baseline script
#   .whl/        pure-Python wheels the GPU machine lacks: omegaconf (+ antlr4 runtime, built from
#                its sdist); with TRL=1 also trl 1.16.0, datasets, dill, multiprocess (the `trl` part)
#   .compile_cache/  made by a device call, not here: copy a call's $OUT/compile_cache.t?z.part-*
#   .before/     with BEFORE=REV: the code of commit REV (hybridengine, csrc, tools, configs,
#                launch), for gpu_session.sh's `ppo_ab` part: a change's before and after in one call
# Usage, from the repo root: bash bench/prepare_carry.sh   (TRL=1 bash bench/prepare_carry.sh,
#   BEFORE=HEAD~1 bash bench/prepare_carry.sh)
set -euo pipefail
shared=${SHARED:-../shared}
mkdir -p .benchdata .whl .compile_cache
rm -rf .benchdata/tok && cp -r "$shared/models/qwen2-tokenizer" .benchdata/tok
cp "$shared/data/gsm8k/train.jsonl" "$shared/data/gsm8k/test.jsonl" "$shared/bench/hf_trl_baseline.py" .benchdata/
cd .whl
ls omegaconf-*.whl > /dev/null 2>&1 || pip download -q --no-deps omegaconf==2.4.0
if ! ls antlr4_python3_runtime-*.whl > /dev/null 2>&1; then
  pip download -q --no-deps --no-binary :all: antlr4-python3-runtime==4.9.3
  pip wheel -q --no-deps antlr4-python3-runtime-4.9.3.tar.gz -w . && rm -f antlr4-python3-runtime-4.9.3.tar.gz
fi
if [ -n "${TRL:-}" ]; then
  # the GPU machine runs Python 3.12: multiprocess ships one wheel per Python version
  pip download -q --no-deps --only-binary=:all: --python-version 3.12 trl==1.16.0 datasets dill multiprocess
fi
cd ..
if [ -n "${BEFORE:-}" ]; then
  rm -rf .before && mkdir .before
  git archive "$BEFORE" hybridengine csrc tools configs launch | tar -x -C .before
  du -sh .before
fi
du -sh .benchdata .whl

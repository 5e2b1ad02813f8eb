#!/usr/bin/env bash
# Start vLLM's OpenAI-compatible server (CPU build, installed by setup.sh) on 127.0.0.1:PORT with
# the default model (an fp32 checkpoint) at vLLM's own default dtype, as its users run it:
# `--dtype auto`, which downcasts fp32 to bfloat16 on a CPU that has it. Extra arguments go to
# vLLM, e.g. `--dtype float32` (the exact mode) or --max-num-batched-tokens 256.
#
#   benchmarks/peers/start_vllm.sh PORT [extra vllm args...]
#   benchmarks/peers/start_vllm.sh --check     # exit 0 if it could start, else say what is missing
#
# It execs the server, so a SIGTERM to this process (group) stops it. Ready when GET /health
# answers 200 (~95-120 s: torch.compile warm-up). Once the engine has started, its output has a
# line `[start_vllm] resolved dtype: torch.bfloat16` (or whatever vLLM chose), read from vLLM's
# own config log line, so every run's log names the dtype it measured.
set -euo pipefail
if [[ $# -lt 1 ]]; then
    echo "usage: $0 PORT [extra vllm args...] | --check" >&2; exit 2
fi
PORT=$1; shift
PEERS_DIR=${PEERS_DIR:-/work/peers}
VENV=$PEERS_DIR/vllm-venv
MODEL=${VLLM_MODEL:-$PEERS_DIR/smollm2-hf}
[[ -x $VENV/bin/python ]] || { echo "no vLLM venv at $VENV: run benchmarks/peers/setup.sh" >&2; exit 1; }
[[ -f $MODEL/config.json ]] || { echo "no model folder at $MODEL: run benchmarks/peers/setup.sh" >&2; exit 1; }

# tcmalloc (Debian libtcmalloc-minimal4) and the venv's Intel OpenMP runtime, preloaded.
# (awk reads to the end: exiting at the first match would SIGPIPE ldconfig, fatal under pipefail)
TCMALLOC=$(/sbin/ldconfig -p 2>/dev/null | awk '/libtcmalloc_minimal\.so\.4 / && !found {found = $NF} END {print found}')
TCMALLOC=${TCMALLOC:-/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4}
IOMP=$(find "$VENV" -name libiomp5.so -print -quit)
[[ -f $TCMALLOC ]] || { echo "missing $TCMALLOC (apt-get install libtcmalloc-minimal4)" >&2; exit 1; }
[[ -n $IOMP ]] || { echo "no libiomp5.so in $VENV" >&2; exit 1; }
export LD_PRELOAD="$TCMALLOC:$IOMP${LD_PRELOAD:+:$LD_PRELOAD}"
[[ $PORT == --check ]] && exit 0

# Bind every core to the worker: by default vLLM reserves one of the two cores and runs ~2x slower.
NCPU=$(nproc)
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-$((NCPU - 1))}
export VLLM_CPU_NUM_OF_RESERVED_CPU=${VLLM_CPU_NUM_OF_RESERVED_CPU:-0}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$NCPU}
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4}   # GiB
# Local files only: no hub look-ups, no usage reports.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1

# The server's output, passed through unchanged, plus one line naming the dtype vLLM resolved
# (its engine logs its config: `..., dtype=torch.bfloat16, ...`). The filter ignores SIGTERM so
# that it outlives the server's shutdown logging and ends at its end of file.
exec > >(trap '' TERM; exec awk '{ print; fflush() }
    !found && match($0, /[ ,(]dtype=torch\.[a-z0-9]+/) {
        found = 1; dtype = substr($0, RSTART + 1, RLENGTH - 1); sub(/^dtype=/, "", dtype)
        print "[start_vllm] resolved dtype: " dtype; fflush()
    }') 2>&1

# `python -m`: the `vllm` console script fails (the package metadata is named vllm-cpu).
exec "$VENV/bin/python" -m vllm.entrypoints.openai.api_server \
    --model "$MODEL" --served-model-name SmolLM2-135M-Instruct \
    --host 127.0.0.1 --port "$PORT" --max-model-len 4096 "$@"

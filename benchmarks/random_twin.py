"""A model directory of a given shape with random weights, for timing (a step's time does not
depend on the weights' values; its tokens do, so no figure of tokens comes from a twin).

    python benchmarks/random_twin.py CONFIG_JSON TOKENIZER_DIR OUT_DIR [--device cuda]

The twin takes CONFIG_JSON's shape (e.g. deploy/model_configs/llama-3.1-8b/config.json) and
TOKENIZER_DIR's tokenizer, whose vocabulary, BOS and EOS it adopts (the default model's cache
directory: 49,152 tokens, so a Llama 3 shape's embedding and LM head are 2.6x smaller than its
own). Weights are bf16, N(0, 0.02) for matrices and 1 for norms, drawn on --device (an 8B
shape's 16 GB are drawn in seconds on a GPU, minutes on CPU cores) and written as safetensors.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def make_twin(config_json: Path, tokenizer_dir: Path, out: Path, device: str = "cpu", seed: int = 0) -> Path:
    if (out / "model.safetensors").exists():
        return out
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    out.chmod(0o700)
    config = json.loads(config_json.read_text())
    vocab_source = json.loads((tokenizer_dir / "config.json").read_text())
    for key in ("vocab_size", "bos_token_id", "eos_token_id"):
        config[key] = vocab_source[key]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out))
    shapes = hub_names({name: w.shape for name, w in model.state_dict().items()}, config)
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for name, shape in shapes.items():
        if config.get("tie_word_embeddings") and name == "lm_head.weight":
            continue
        if len(shape) == 1:  # a norm's weight
            tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            w = torch.empty(shape, dtype=torch.bfloat16, device=device).normal_(0.0, 0.02, generator=gen)
            tensors[name] = w.cpu()
    save_file(tensors, out / "model.safetensors")
    for f in out.iterdir():  # owner-only, as the directory
        f.chmod(0o600)
    return out


def hub_names(shapes: dict, config: dict) -> dict:
    """transformers 5 holds a mixture's experts stacked ([E, 2I, H] gate_up, [E, H, I] down); its
    checkpoints, and every engine's loader, name each expert's matrices: Mixtral's
    block_sparse_moe.experts.e.w1/w3/w2, Qwen3-MoE's mlp.experts.e.gate/up/down_proj."""
    mixtral = config["architectures"][0] == "MixtralForCausalLM"
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    out = {}
    for name, shape in shapes.items():
        block = name.replace(".mlp.", ".block_sparse_moe.") if mixtral else name
        if name.endswith(".experts.gate_up_proj"):
            prefix, (experts, rows, cols) = block.removesuffix("gate_up_proj"), shape
            for e in range(experts):
                out[f"{prefix}{e}.{gate}.weight"] = (rows // 2, cols)
                out[f"{prefix}{e}.{up}.weight"] = (rows // 2, cols)
        elif name.endswith(".experts.down_proj"):
            prefix, (experts, rows, cols) = block.removesuffix("down_proj"), shape
            for e in range(experts):
                out[f"{prefix}{e}.{down}.weight"] = (rows, cols)
        elif name.endswith(".mlp.gate.weight") and mixtral:
            out[block] = shape
        else:
            out[name] = shape
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config_json", type=Path)
    p.add_argument("tokenizer_dir", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--device", default="cpu", help="where the random weights are drawn")
    args = p.parse_args()
    print(make_twin(args.config_json, args.tokenizer_dir, args.out, args.device))


if __name__ == "__main__":
    main()

"""A GGUF file's own quantized blocks for the decoder layers' linears and the LM head, kept beside
the converted checkpoint so that `--quantization int4` or `int8` runs on the file's weights as they are, not on
the bf16 copy quantized again.

Q4_0, Q4_1 and Q8_0 blocks of 32 are each asymmetric codes in one group of engine/linear.py's
GROUP: Q4_1 w = d q + m (codes q, scale d, zero m), Q4_0 w = d (q - 8) (zero -8 d), Q8_0 w = d q
with q a signed byte (codes q + 128, zero -128 d). Q4 codes fit int4 and int8, Q8_0's only int8.
The blocks are written once, when the file is converted (engine/model_source.py), and only for a
tensor whose blocks, dequantized, give back the converted checkpoint's tensor to its dtype's
rounding (rows in the checkpoint's order: llama.cpp permutes Llama's q and k rows, and the check
proves the inverse), so a layout this file does not know falls back to quantizing the bf16 copy.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)

BLOCKS_FILE = Path("gguf_blocks") / "blocks.safetensors"  # not *.safetensors at the top: not a checkpoint shard
# GGUF's tensor names in a block -> the checkpoint's under model.layers.{i}.
LINEARS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# The embedding (the LM head too where tied) and an untied output, as llama.cpp's output reads them.
HEADS = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight"}
CODE_BITS = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}  # the fewest bits a block type's codes need
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


def decode(kind: str, raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """raw [N, G * BLOCK_BYTES] uint8 -> (codes [N, 32 G] uint8, scales [N, G] fp32, zeros [N, G] fp32)."""
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, BLOCK_BYTES[kind])
    d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q8_0":
        codes = (blocks[..., 2:].copy().view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        zeros = -128 * d
    else:
        qs = blocks[..., 4:] if kind == "Q4_1" else blocks[..., 2:]
        codes = np.concatenate([qs & 15, qs >> 4], axis=-1)  # byte j: weights j and j + 16
        zeros = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if kind == "Q4_1" else -8 * d
    return torch.from_numpy(codes.reshape(n, -1)), torch.from_numpy(d), torch.from_numpy(np.ascontiguousarray(zeros))


def unpermute(t: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of llama.cpp's row permutation of Llama's q and k (its convert_hf_to_gguf.py)."""
    return t.reshape(heads, t.shape[0] // heads // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def save(gguf: Path, model_dir: Path) -> int:
    """Write the blocks of every decoder linear and head the check passes into model_dir; returns how many."""
    from gguf import GGUFReader
    from safetensors import safe_open
    from safetensors.torch import save_file

    from engine.linear import dequantize_groups

    config = json.loads((model_dir / "config.json").read_text())
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config.get("num_key_value_heads")}
    shards = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            shards.update({name: path for name in f.keys()})
    out, kinds = {}, {}
    for tensor in GGUFReader(gguf).tensors:
        parts = tensor.name.split(".")  # blk.{i}.{kind}.weight, or a head
        kind = tensor.tensor_type.name
        if tensor.name in HEADS:
            name = HEADS[tensor.name]
        elif len(parts) == 4 and parts[0] == "blk" and parts[2] in LINEARS:
            name = f"model.layers.{parts[1]}.{LINEARS[parts[2]]}.weight"
        else:
            continue
        if kind not in CODE_BITS or name not in shards:
            continue
        codes, scales, zeros = decode(kind, np.asarray(tensor.data))
        with safe_open(str(shards[name]), framework="pt") as f:
            converted = f.get_tensor(name)
        candidates = [(codes, scales, zeros)]
        if (
            len(parts) == 4
            and parts[2] in heads
            and config.get("model_type") in ("llama", "mistral")
            and heads[parts[2]]
        ):
            candidates.insert(0, tuple(unpermute(t, heads[parts[2]]) for t in (codes, scales, zeros)))
        for c, s, z in candidates:
            if c.shape == converted.shape and torch.allclose(
                dequantize_groups(c, s, z), converted.float(), rtol=2**-7, atol=1e-6
            ):  # a bf16 rounding apart at most; a wrong row order is far off
                out.update({f"{name}.codes": c.contiguous(), f"{name}.scales": s.contiguous(), f"{name}.zeros": z})
                kinds[name] = kind
                break
        else:
            log.warning("gguf: %s's %s blocks do not give back the converted tensor: quantized again", name, kind)
    if out:
        (model_dir / BLOCKS_FILE).parent.mkdir(mode=0o700, exist_ok=True)
        save_file(out, str(model_dir / BLOCKS_FILE), metadata={"kinds": json.dumps(kinds)})
    return len(kinds)


def load(model_dir: Path, bits: int = 8) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]]:
    """checkpoint tensor name -> (codes, scales, zeros, block type) of the blocks whose codes fit `bits`."""
    path = Path(model_dir) / BLOCKS_FILE
    if not path.is_file():
        return {}
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        kinds = json.loads(f.metadata()["kinds"])
        return {
            name: (f.get_tensor(f"{name}.codes"), f.get_tensor(f"{name}.scales"), f.get_tensor(f"{name}.zeros"), kind)
            for name, kind in kinds.items()
            if CODE_BITS[kind] <= bits
        }

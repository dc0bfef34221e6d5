"""`pdserve plan memory`: what a model costs in memory, from its config.json alone.

    pdserve plan memory --config deploy/model_configs/llama-3.1-8b/config.json --dtype bfloat16 \\
        --memory-gb 80 --seq-len 4096 --json

Weights: every parameter of the Llama-family block (embeddings, q/k/v/o, the SwiGLU MLP, the
norms, a qkv bias and Qwen3's per-head q/k norms where the config has them, the LM head unless
tied) at the dtype's size; with --quantization int8 or int4 the decoder layers' linears at a byte
or half a byte a weight, and 8 bytes a group of 32 weights (a fp32 scale and zero). KV per token:
2 (K and V) x layers x kv_heads x head_dim x dtype bytes (engine/model_config.py, the engine's
own formula). With --memory-gb: the tokens of KV that fit beside the weights, and with --seq-len
the sequences of that length. Activations, the CUDA context and allocator slack are not counted:
take them off --memory-gb (or leave a --reserve-gb).
"""

from __future__ import annotations

import json
from pathlib import Path

from engine.config import DTYPES, QUANTIZATIONS
from engine.model_config import ModelConfig
from serving.options import HelpFormatter

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
PLAN_DTYPES = tuple(d for d in DTYPES if d in DTYPE_BYTES)  # "auto" depends on the machine
GB = 1 << 30


def num_params(cfg: ModelConfig, active: bool = False) -> int:
    """Parameters of a Llama-family checkpoint with this config (Gemma's: two more norms a layer).
    active: those one token's forward uses (a mixture of experts' top-k experts, not all)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    attention = cfg.hidden_size * (q + 2 * kv) + q * cfg.hidden_size + ((q + 2 * kv) if cfg.qkv_bias else 0)
    norms = (4 if cfg.gemma_norms else 2) * cfg.hidden_size + (2 * cfg.head_dim if cfg.qk_norm else 0)
    dense_mlp = 3 * cfg.hidden_size * cfg.intermediate_size
    experts = cfg.num_experts_per_tok if active else cfg.num_experts
    sparse_mlp = experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size + cfg.num_experts * cfg.hidden_size
    if cfg.shared_expert_intermediate_size:  # Qwen2-MoE: every token's shared expert and its gate
        sparse_mlp += 3 * cfg.hidden_size * cfg.shared_expert_intermediate_size + cfg.hidden_size
    num_sparse = len(cfg.moe_layers)
    layers = cfg.num_layers * (attention + norms) + (cfg.num_layers - num_sparse) * dense_mlp + num_sparse * sparse_mlp
    embeddings = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    return layers + embeddings + cfg.hidden_size  # the final norm


def linear_shapes(cfg: ModelConfig) -> list[tuple[int, int, int]]:
    """(how many, output channels, input features) of the decoder layers' linears: what
    --quantization holds as codes (attention, MLPs and experts; not the embeddings, the LM head,
    the norms, a qkv bias or a MoE router, which choose experts and stay in the model dtype)."""
    q, kv, h = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size
    layers, num_sparse = cfg.num_layers, len(cfg.moe_layers)
    shapes = [(layers, q + 2 * kv, h), (layers, h, q)]
    if layers > num_sparse:
        shapes += [(layers - num_sparse, 2 * cfg.intermediate_size, h), (layers - num_sparse, h, cfg.intermediate_size)]
    if num_sparse:
        e, moe = cfg.num_experts, cfg.moe_intermediate_size
        shapes += [(num_sparse * e, 2 * moe, h), (num_sparse * e, h, moe)]
        if cfg.shared_expert_intermediate_size:
            shared = cfg.shared_expert_intermediate_size
            shapes += [(num_sparse, 2 * shared, h), (num_sparse, h, shared)]
    return shapes


def quantized_bytes(cfg: ModelConfig, quantization: str) -> tuple[int, int]:
    """(weights, their bytes) of the decoder layers' linears under a quantization: codes of
    engine/linear.py's BITS, and a fp32 scale and zero a GROUP of k and output channel."""
    from engine.linear import BITS, GROUP

    shapes = linear_shapes(cfg)
    weights = sum(c * n * k for c, n, k in shapes)
    groups = sum(c * n * -(-k // GROUP) for c, n, k in shapes)
    return weights, weights * BITS[quantization] // 8 + 8 * groups


def memory(
    cfg: ModelConfig,
    dtype: str,
    memory_gb: float | None = None,
    reserve_gb: float = 0.0,
    seq_len: int | None = None,
    quantization: str = "none",
) -> dict:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {PLAN_DTYPES}, got {dtype!r}")
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    size = DTYPE_BYTES[dtype]
    params = num_params(cfg)
    weight_bytes = params * size
    if quantization != "none":
        linear, codes = quantized_bytes(cfg, quantization)
        weight_bytes += codes - linear * size
    plan = {
        "dtype": dtype,
        "quantization": quantization,
        "num_params": params,
        "num_active_params": num_params(cfg, active=True),  # per token: all of them but a MoE's unpicked experts
        "weight_bytes": weight_bytes,
        "kv_bytes_per_token": cfg.kv_bytes_per_token(size),
        "num_layers": cfg.num_layers,
        "num_kv_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
    }
    if memory_gb is not None:
        free = int((memory_gb - reserve_gb) * GB) - plan["weight_bytes"]
        if free <= 0:
            raise ValueError(
                f"the weights ({plan['weight_bytes'] / GB:.1f} GiB in {dtype}) do not fit in "
                f"--memory-gb {memory_gb} less --reserve-gb {reserve_gb}"
            )
        plan.update(memory_bytes=int(memory_gb * GB), kv_bytes=free, max_tokens=free // plan["kv_bytes_per_token"])
        if seq_len:
            plan.update(seq_len=seq_len, max_sequences=plan["max_tokens"] // seq_len)
    return plan


def _config_dir(path: str) -> Path:
    p = Path(path)
    if p.is_file():
        return p.parent
    if (p / "config.json").is_file():
        return p
    raise ValueError(f"--config {path}: no config.json there")


def add_args(sub) -> None:
    m = sub.add_parser(
        "memory",
        help="weight bytes, KV bytes per token, and what a node's memory holds",
        description=__doc__.split("\n\n", 2)[2].replace("\n", " "),
        formatter_class=HelpFormatter,
    )
    m.add_argument("--config", required=True, help="a Llama-family config.json (or its directory)")
    m.add_argument("--dtype", required=True, choices=PLAN_DTYPES, help="the weights' and the KV's dtype")
    m.add_argument(
        "--quantization",
        default="none",
        choices=QUANTIZATIONS,
        help="the decoder layers' linears quantized (int8, int4: weight-only, groups of 32)",
    )
    m.add_argument("--memory-gb", type=float, default=None, help="a node's memory for weights and KV, in GiB")
    m.add_argument("--reserve-gb", type=float, default=0.0, help="of that, kept for activations and the runtime")
    m.add_argument("--seq-len", type=int, default=None, help="tokens per sequence, for max_sequences")
    m.add_argument("--json", action="store_true", help="print one JSON object")


def main(args) -> int:
    if args.memory_gb is not None and args.memory_gb <= 0:
        raise ValueError("--memory-gb must be > 0")
    if args.seq_len is not None and args.seq_len < 1:
        raise ValueError("--seq-len must be >= 1")
    plan = memory(
        ModelConfig.from_dir(_config_dir(args.config)),
        args.dtype,
        args.memory_gb,
        args.reserve_gb,
        args.seq_len,
        args.quantization,
    )
    if args.json:
        print(json.dumps(plan))
        return 0
    held = args.dtype + (f", the layers' linears {args.quantization}" if args.quantization != "none" else "")
    print(f"{plan['num_params'] / 1e9:.2f} B parameters: weights {plan['weight_bytes'] / GB:.2f} GiB in {held}")
    if plan["num_active_params"] != plan["num_params"]:
        print(f"{plan['num_active_params'] / 1e9:.2f} B of them active per token (the routed experts)")
    print(
        f"KV per token: {plan['kv_bytes_per_token']:,} bytes (2 x {plan['num_layers']} layers x "
        f"{plan['num_kv_heads']} kv heads x {plan['head_dim']} x {DTYPE_BYTES[args.dtype]} bytes)"
    )
    if "max_tokens" in plan:
        line = f"in {args.memory_gb:g} GiB: {plan['kv_bytes'] / GB:.2f} GiB of KV, {plan['max_tokens']:,} tokens"
        if "max_sequences" in plan:
            line += f", {plan['max_sequences']:,} sequences of {plan['seq_len']:,}"
        print(line)
    return 0

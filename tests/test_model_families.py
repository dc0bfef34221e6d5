"""The model families beyond Llama (Qwen3, Phi-3, Gemma 2 and 3, Mixtral, Qwen2/3-MoE) from
checkpoints saved as a user's would be, built from transformers' own config classes in several
shapes: fp32 logits and greedy tokens equal to transformers', the same tokens through the P/D
split, every engine feature together (tests/combinations.py's mixes), deterministic mode's tokens
invariant to the batch, and negative controls that break what a family adds and must fail."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from cluster import local_cluster, wait_for_no_blocks
from combinations import Reference, Report, cluster_mix, engine_mix
from conftest import engine_alone, make_engine
from test_model_equality import ATOL, PROMPTS, check_prefill_then_decode, hf_last_logits
from tiny_models import make_tiny_model
from transformers import AutoModelForCausalLM

from engine import cpu_kernels
from engine.model_config import ModelConfig
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence
from kvtransfer.layout import KVLayout, KVLayoutMismatch
from pdserve.plan.memory import memory
from router.client import AsyncClient

# name -> (arch, seed, shape): GQA groups 1-4 and MQA, head sizes unequal to hidden / heads, tied
# and untied heads, windows shorter than the prompts on every layer or on some (Gemma's patterns,
# Qwen's max_window_layers); head sizes the C++ decode kernel takes (16, 32) and one it does not (24);
# mixtures of 4 and 8 experts, top-2 and top-3, dense layers among sparse ones, renormalized or not
SHAPES = {
    "qwen3-gqa2-head32": ("qwen3", 11, dict(head_dim=32)),
    "qwen3-mqa-head24-tied": ("qwen3", 12, dict(num_key_value_heads=1, head_dim=24, tie=True)),
    "qwen3-gqa3-head16": ("qwen3", 13, dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=2)),
    "phi3-window5": ("phi3", 14, dict(sliding_window=5)),
    "phi3-mha": ("phi3", 15, dict(num_key_value_heads=4)),
    "qwen3-window-on-layer1": ("qwen3", 16, dict(use_sliding_window=True, sliding_window=4, max_window_layers=1)),
    "gemma2-window5-tied": ("gemma2", 17, dict(num_hidden_layers=3, sliding_window=5, tie=True)),
    "gemma2-mqa-head32": ("gemma2", 29, dict(num_key_value_heads=1, head_dim=32, sliding_window=4)),
    "gemma3-pattern6-window4-tied": ("gemma3", 19, dict(num_hidden_layers=7, sliding_window=4, tie=True)),
    "gemma3-gqa4-head24": (
        "gemma3",
        24,
        dict(num_attention_heads=8, num_key_value_heads=2, head_dim=24, sliding_window=3, sliding_window_pattern=2),
    ),
    "mixtral-4x2": ("mixtral", 21, {}),
    "mixtral-8x2-window4-tied": ("mixtral", 22, dict(num_local_experts=8, sliding_window=4, tie=True)),
    "qwen3moe-8x2-dense-layer1": ("qwen3_moe", 23, dict(num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=True)),
    "qwen2moe-8x2-shared": ("qwen2_moe", 26, dict(mlp_only_layers=[0])),
    "qwen3moe-8x3-step2-mqa-head24": (
        "qwen3_moe",
        24,
        dict(decoder_sparse_step=2, num_experts_per_tok=3, num_key_value_heads=1, head_dim=24),
    ),
}
ROOT = Path(__file__).resolve().parent.parent
LAYER_KINDS = ("full_attention", "sliding_attention")
GREEDY = dict(max_tokens=12, temperature=0, ignore_eos=True)


# Phi-3 128k's RoPE in miniature: a pretraining length of 32 extended to 256, a factor per frequency
LONGROPE = dict(
    rope_type="longrope",
    rope_theta=10000.0,
    short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 4.0],
    long_factor=[1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 14.0, 20.0],
)
LONG_PROMPTS = [[(7 * i + j) % 300 + 1 for i in range(n)] for j, n in enumerate((40, 33, 61))]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    """SHAPES, and "phi3-longrope" (not in SHAPES: an engine of its full context uses the long
    factors, transformers the short ones on prompts as short as PROMPTS; its own tests below)."""
    built = {
        name: make_tiny_model(tmp_path_factory.mktemp(name), arch, seed=seed, **shape)
        for name, (arch, seed, shape) in SHAPES.items()
    }
    longrope = dict(rope_parameters=LONGROPE, max_position_embeddings=256, original_max_position_embeddings=32)
    built["phi3-longrope"] = make_tiny_model(tmp_path_factory.mktemp("phi3-longrope"), "phi3", seed=27, **longrope)
    return built


@pytest.fixture(scope="module")
def longrope(models) -> Path:
    return models["phi3-longrope"]


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["cpu-kernels", "plain-torch"])
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_logits_match_transformers_over_prefill_and_mixed_decode_steps(models, name, cpu_kernels):
    check_prefill_then_decode(models[name], cpu_kernels=cpu_kernels)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_greedy_tokens_equal_transformers_generate(models, name):
    hf = AutoModelForCausalLM.from_pretrained(models[name], dtype=torch.float32).eval()
    ours = engine_alone(models[name], PROMPTS, **GREEDY)  # all prompts batched in one engine
    for prompt, tokens in zip(PROMPTS, ours):
        out = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=hf.config.vocab_size,
            pad_token_id=0,
        )
        assert out[0, len(prompt) :].tolist() == tokens, name


def _prefill_logits_match(hf_dir, engine_dir=None, tamper=None, prompt=PROMPTS[2]) -> bool:
    """The last prompt position's fp32 logits, the engine's (on engine_dir, tampered with) against
    transformers' (on hf_dir)."""
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    engine = make_engine(engine_dir or hf_dir)
    if tamper:
        tamper(engine.runner.model)
    seq = Sequence("r", list(prompt), SamplingParams(temperature=0))
    engine.block_manager.allocate(seq, seq.num_tokens)
    _, _, logits = engine.runner.forward(ScheduledBatch([seq], [seq.num_tokens]))
    return torch.allclose(logits[0], hf_last_logits(hf, prompt), atol=ATOL, rtol=0)


def test_the_negative_control_fails_without_qwen3s_head_norms(models):
    """The same check as above, with the per-head q/k norm skipped: it must not pass."""
    model = models["qwen3-gqa2-head32"]
    assert _prefill_logits_match(model)

    def no_head_norms(m):
        for layer in m.w.layers:
            layer.q_norm = layer.k_norm = None

    assert not _prefill_logits_match(model, tamper=no_head_norms)


def test_the_negative_control_fails_without_phi3s_window(models, tmp_path):
    """Phi-3's window (5 tokens; the prompt has 13) dropped from its config.json: the logits part."""
    model = models["phi3-window5"]
    assert _prefill_logits_match(model)
    assert not _prefill_logits_match(model, engine_dir=_tampered_config(model, tmp_path, sliding_window=None))


@pytest.mark.parametrize(
    "transport, local_prefill", [("shm", "off"), ("tcp", "off"), ("shm", "always"), ("tcp", "always")]
)
@pytest.mark.parametrize(
    "name",
    [
        "qwen3-mqa-head24-tied",
        "phi3-window5",
        "phi3-longrope",
        "gemma2-window5-tied",
        "gemma3-gqa4-head24",
        "mixtral-8x2-window4-tied",
        "qwen3moe-8x2-dense-layer1",
        "qwen2moe-8x2-shared",
    ],
)
def test_the_pd_split_gives_the_engines_tokens(models, name, transport, local_prefill):
    """Remote prefill (the KV over shm or tcp, layer by layer) and local prefill on the decode node."""
    model = models[name]
    reference = engine_alone(model, PROMPTS, **GREEDY)

    async def scenario():
        async with local_cluster(model, kv_transport=transport, local_prefill=local_prefill) as (
            router,
            prefills,
            decodes,
        ):
            async with AsyncClient(router.address) as client:
                for prompt, ref in zip(PROMPTS, reference):
                    result = await client.generate(prompt, **GREEDY)
                    assert result.token_ids == ref
            await wait_for_no_blocks(prefills + decodes)

    asyncio.run(scenario())


def test_longrope_short_factors_match_transformers_within_the_pretraining_length(longrope):
    """An engine whose context fits the pretraining length rotates by the short factors, as
    transformers does for every sequence no longer than that (these reach 19 tokens)."""
    check_prefill_then_decode(longrope, max_model_len=32)


def test_longrope_long_factors_match_transformers_past_the_pretraining_length(longrope):
    """An engine of the extended context rotates by the long factors, as transformers does for a
    sequence past the pretraining length (the prompts here hold 33 to 61 tokens)."""
    check_prefill_then_decode(longrope, prompts=LONG_PROMPTS)
    hf = AutoModelForCausalLM.from_pretrained(longrope, dtype=torch.float32).eval()
    for prompt, tokens in zip(LONG_PROMPTS, engine_alone(longrope, LONG_PROMPTS, **GREEDY)):
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=320, pad_token_id=0)
        assert out[0, len(prompt) :].tolist() == tokens


def test_longrope_reads_phi3s_own_config_and_fails_with_the_factors_swapped(longrope, tmp_path):
    """Phi-3's config.json writes rope_scaling {"type": "su" or "longrope", ...} beside a top-level
    original_max_position_embeddings: read the same; the factors swapped: the logits part."""
    cfg = json.loads((longrope / "config.json").read_text())
    legacy = dict(
        rope_scaling={"type": "su", "short_factor": LONGROPE["short_factor"], "long_factor": LONGROPE["long_factor"]},
        rope_theta=10000.0,
        rope_parameters=None,
    )
    assert cfg["original_max_position_embeddings"] == 32
    ours = ModelConfig.from_dir(longrope)
    assert ModelConfig.from_dir(_tampered_config(longrope, tmp_path / "legacy", **legacy)).rope == ours.rope
    assert ours.rope["factor"] == 8.0 and ours.for_context(33).rope["long_factors"]
    assert (ours.for_context(32).attention, ours.for_context(256).attention) == (
        "full; LongRoPE short factors",
        "full; LongRoPE long factors",
    )
    swapped = dict(LONGROPE, short_factor=LONGROPE["long_factor"], long_factor=LONGROPE["short_factor"])
    assert _prefill_logits_match(longrope, prompt=LONG_PROMPTS[2])
    tampered = _tampered_config(longrope, tmp_path / "swapped", rope_parameters=swapped)
    assert not _prefill_logits_match(longrope, engine_dir=tampered, prompt=LONG_PROMPTS[2])


def test_longrope_prefill_and_decode_nodes_of_other_contexts_refuse_each_others_kv(longrope):
    """A prefill node that rotates keys by the short factors cannot hand them to a decode node
    that reads them by the long ones: the layout check names the difference."""
    short, long = (make_engine(longrope, max_model_len=n) for n in (32, 256))
    layouts = [KVLayout.of(e.kv_cache, "m", e.numerics, e.model_config.attention) for e in (long, short)]
    with pytest.raises(KVLayoutMismatch, match="attention: decode 'full; LongRoPE long factors', prefill 'full; Lo"):
        layouts[0].check(layouts[1])


MIXED = ["qwen3-gqa2-head32", "phi3-window5", "phi3-longrope", "gemma2-mqa-head32", "gemma3-gqa4-head24"]
MIXED += ["mixtral-4x2", "qwen3moe-8x2-dense-layer1", "qwen2moe-8x2-shared"]


@pytest.mark.parametrize("name", MIXED)
def test_random_mixes_of_every_feature_equal_each_request_alone(models, name):
    """Batches, chunked prefills, the prefix cache, preemption, speculation, n > 1, beams, stops,
    cancels (fp32), in one engine and through a cluster with a decode node killed."""
    report, reference = Report(), Reference()
    for seed in range(6):
        engine_mix(models[name], seed, 16, report, reference)
    asyncio.run(cluster_mix(models[name], 104, 24, report, reference))
    print(report)
    assert not report.wrong, report.wrong[:3]
    assert not report.leaked, report.leaked
    assert report.cache_hit_tokens and report.spec_accepted and report.preemptions


@pytest.mark.skipif(not cpu_kernels.load(), reason="deterministic mode needs the C++ CPU kernels")
@pytest.mark.parametrize(
    "name", ["qwen3-gqa2-head32", "phi3-window5", "gemma2-window5-tied", "gemma3-pattern6-window4-tied", "mixtral-4x2"]
)
def test_deterministic_mode_is_invariant_to_the_batch_in_bf16(models, name):
    report, reference = Report(), Reference.deterministic("bfloat16")
    for seed in range(6):
        engine_mix(models[name], seed, 16, report, reference)
    print(report)
    assert not report.wrong, report.wrong[:3]


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_plan_memory_counts_the_checkpoints_parameters_and_the_engines_kv(models, name):
    cfg = ModelConfig.from_dir(models[name])
    p = memory(cfg, "float32")
    assert p["num_params"] == AutoModelForCausalLM.from_pretrained(models[name]).num_parameters()
    engine = make_engine(models[name])
    assert p["kv_bytes_per_token"] == engine.kv_cache.bytes_per_block // engine.config.block_size


def test_the_configs_say_which_layers_slide(models):
    """layer_types as transformers wrote them: Qwen's max_window_layers, Gemma 2's every other
    layer, Gemma 3's five in six, and a pattern of its own."""
    expect = {
        "qwen3-window-on-layer1": (4, (1,)),
        "gemma2-window5-tied": (5, (0, 2)),
        "gemma3-pattern6-window4-tied": (4, (0, 1, 2, 3, 4, 6)),
        "gemma3-gqa4-head24": (3, (0,)),
    }
    for name, (window, layers) in expect.items():
        cfg = ModelConfig.from_dir(models[name])
        assert (cfg.sliding_window, cfg.local_window, cfg.local_layers) == (None, window, layers), name
    # what the KV layout check compares across the P/D split
    assert ModelConfig.from_dir(models["gemma2-window5-tied"]).attention == "window 5 on layers 0,2"
    assert ModelConfig.from_dir(models["phi3-window5"]).attention == "window 5"
    assert ModelConfig.from_dir(models["qwen3-gqa2-head32"]).attention == "full"


def _tampered_config(model: Path, tmp_path: Path, **changes) -> Path:
    """A copy of the checkpoint with config.json's fields changed."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    for f in model.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


@pytest.mark.parametrize(
    "name, changes",
    [
        ("gemma2-window5-tied", dict(attn_logit_softcapping=None)),
        ("gemma2-window5-tied", dict(final_logit_softcapping=None)),
        ("gemma2-window5-tied", dict(layer_types=["full_attention"] * 3)),
        ("gemma2-window5-tied", dict(query_pre_attn_scalar=16)),
        (
            "gemma3-pattern6-window4-tied",
            dict(rope_parameters={k: {"rope_type": "default", "rope_theta": 1e6} for k in LAYER_KINDS}),
        ),
        ("qwen3-window-on-layer1", dict(layer_types=["full_attention"] * 2)),
    ],
    ids=["attn-softcap", "final-softcap", "windows", "scale", "local-rope", "qwen-window"],
)
def test_the_negative_controls_fail_without_what_the_config_adds(models, tmp_path, name, changes):
    """Each thing the family's config.json adds, taken out for the engine alone: the logits part."""
    model = models[name]
    assert _prefill_logits_match(model)
    assert not _prefill_logits_match(model, engine_dir=_tampered_config(model, tmp_path, **changes))


def test_the_negative_control_fails_without_gemmas_one_plus_w_norms(models):
    def plain_norms(m):
        for layer in m.w.layers:
            for norm in (layer.input_norm, layer.post_norm, layer.attn_out_norm, layer.mlp_out_norm):
                norm -= 1

    assert not _prefill_logits_match(models["gemma2-mqa-head32"], tamper=plain_norms)


def test_the_configs_say_which_layers_route_to_experts(models):
    expect = {
        "mixtral-4x2": ((0, 1), 4, 2, True),
        "qwen3moe-8x2-dense-layer1": ((0, 2), 8, 2, True),
        "qwen3moe-8x3-step2-mqa-head24": ((1,), 8, 3, False),
        "qwen2moe-8x2-shared": ((1,), 8, 2, False),
    }
    for name, fields in expect.items():
        cfg = ModelConfig.from_dir(models[name])
        assert (cfg.moe_layers, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_renormalize) == fields, name


@pytest.mark.parametrize(
    "name, changes",
    [
        ("qwen3moe-8x2-dense-layer1", dict(norm_topk_prob=False)),
        ("qwen3moe-8x3-step2-mqa-head24", dict(num_experts_per_tok=2)),
        ("mixtral-4x2", dict(num_experts_per_tok=1)),
        ("qwen2moe-8x2-shared", dict(qkv_bias=False)),
    ],
    ids=["renormalize", "top-k", "mixtral-top-k", "qwen2moe-bias"],
)
def test_the_negative_controls_fail_with_another_routing(models, tmp_path, name, changes):
    model = models[name]
    assert _prefill_logits_match(model)
    assert not _prefill_logits_match(model, engine_dir=_tampered_config(model, tmp_path, **changes))


def test_a_moe_checkpoint_missing_an_expert_is_refused_naming_the_tensor(models, tmp_path):
    """A config that puts experts where the checkpoint has a dense MLP (or lacks an expert)."""
    model = _tampered_config(models["qwen3moe-8x2-dense-layer1"], tmp_path, mlp_only_layers=[])
    with pytest.raises(ValueError, match=r"lacks tensor 'model.layers.1.mlp.gate.weight'"):
        make_engine(model)


def test_an_unknown_architecture_is_refused_naming_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPTNeoXForCausalLM"]}))
    with pytest.raises(ValueError, match=r"'GPTNeoXForCausalLM' is not supported; supported: .*Qwen3ForCausalLM"):
        ModelConfig.from_dir(tmp_path)


@pytest.mark.parametrize(
    "name, public",
    [
        ("qwen3-8b", 8.2e9),
        ("qwen3-0.6b", 0.6e9),
        ("phi-3-mini-4k", 3.8e9),
        ("gemma-2-2b", 2.6e9),
        ("gemma-3-1b", 1.0e9),
    ],
)
def test_the_shipped_configs_count_what_transformers_builds_from_them(name, public):
    """deploy/model_configs/: `plan memory`'s count equals transformers' model built from the same
    config.json (on the meta device: no weights), and the model card's rounded size."""
    from transformers import AutoConfig

    path = ROOT / "deploy" / "model_configs" / name
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    count = memory(ModelConfig.from_dir(path), "bfloat16")["num_params"]
    assert count == hf.num_parameters()
    assert round(count / 1e8) / 10 == public / 1e9


@pytest.mark.parametrize("name, active", [("mixtral-8x7b", 12.9e9), ("qwen3-30b-a3b", 3.3e9), ("qwen3-8b", 8.2e9)])
def test_plan_memory_counts_a_mixtures_active_parameters(name, active):
    """The parameters one token's forward reads, within 2% of the model cards' (12.9B of Mixtral
    8x7B's 46.7B, 3.3B of Qwen3-30B-A3B's 30.5B), and all of a dense model's."""
    plan = memory(ModelConfig.from_dir(ROOT / "deploy" / "model_configs" / name), "bfloat16")
    assert abs(plan["num_active_params"] / active - 1) < 0.02
    assert (plan["num_active_params"] == plan["num_params"]) == (name == "qwen3-8b")


def test_a_sharded_checkpoint_loads_as_the_whole_one(models, tmp_path):
    """model-0000i-of-0000n.safetensors with its index, as large checkpoints ship."""
    model = models["qwen3-gqa2-head32"]
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (tmp_path / f).write_bytes((model / f).read_bytes())
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 1
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert _prefill_logits_match(model, engine_dir=tmp_path)


@pytest.mark.parametrize("name", ["mixtral-4x2", "qwen3moe-8x2-dense-layer1", "gemma3-gqa4-head24"])
def test_a_random_twin_names_its_tensors_as_the_checkpoint_does(models, tmp_path, name):
    """benchmarks/random_twin.py writes what transformers' save_pretrained writes (a mixture's
    experts one by one, not stacked as transformers 5 holds them), so every loader reads it."""
    import importlib.util

    from safetensors import safe_open

    spec = importlib.util.spec_from_file_location("random_twin", ROOT / "benchmarks" / "random_twin.py")
    twin_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(twin_module)
    model = models[name]
    twin = twin_module.make_twin(model / "config.json", model, tmp_path / "twin")

    def shapes(path: Path) -> dict:
        with safe_open(str(path / "model.safetensors"), framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}

    assert shapes(twin) == shapes(model)
    make_engine(twin)  # and the engine loads it


@pytest.fixture(scope="module")
def gemma3_multimodal(tmp_path_factory) -> Path:
    """Gemma 3 4B-27B's kind of checkpoint: a vision tower, a projector and the language model."""
    path = tmp_path_factory.mktemp("gemma3-multimodal")
    return make_tiny_model(
        path, "gemma3_multimodal", seed=25, num_hidden_layers=3, sliding_window=4, tie=True, sliding_window_pattern=2
    )


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["cpu-kernels", "plain-torch"])
def test_a_multimodal_gemma3s_language_model_serves_text_as_transformers_does(gemma3_multimodal, cpu_kernels):
    """Text in, text out: the engine loads the language model alone (the vision tower's weights
    are not read) and its fp32 logits equal Gemma3ForConditionalGeneration's on text."""
    cfg = ModelConfig.from_dir(gemma3_multimodal)
    assert (cfg.architecture, cfg.num_layers, cfg.local_layers) == ("Gemma3ForCausalLM", 3, (0, 2))
    check_prefill_then_decode(gemma3_multimodal, cpu_kernels=cpu_kernels)


def test_the_multimodal_gemma3_configs_count_the_language_models_parameters(gemma3_multimodal):
    """plan memory counts what the engine loads: the language model (its head tied), not the
    vision tower; the shipped Gemma 3 12B config (its text_config written as a diff against
    transformers' defaults, as on the hub) gives transformers' count of 11.77 B."""
    from transformers import AutoConfig

    hf = AutoModelForCausalLM.from_pretrained(gemma3_multimodal)
    assert memory(ModelConfig.from_dir(gemma3_multimodal), "float32")["num_params"] == (
        hf.model.language_model.num_parameters()
    )
    path = ROOT / "deploy" / "model_configs" / "gemma-3-12b"
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    count = memory(ModelConfig.from_dir(path), "bfloat16")["num_params"]
    assert count == hf.model.language_model.num_parameters()
    assert round(count / 1e8) / 10 == 11.8


def test_the_negative_control_fails_without_qwen2_moes_shared_expert(models):
    def no_shared_expert(m):
        for layer in m.w.layers:
            if layer.moe is not None:
                layer.moe.shared_gate_up = None

    assert not _prefill_logits_match(models["qwen2moe-8x2-shared"], tamper=no_shared_expert)

"""Bad input gets a ValueError naming the field and the allowed range, and never disturbs the
requests already running."""

from __future__ import annotations

import pytest
from conftest import assert_no_blocks_used, make_engine, run_to_completion

from engine import LLM, EngineConfig, SamplingParams

PROMPT = [5, 17, 33, 8, 90]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"seed": "x"}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-3]}, "stop_token_ids"),
        ({"logprobs": 21}, "logprobs"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"dtype": "int8"}, "dtype"),
        ({"device": "tpu"}, "device"),
        ({"block_size": 3}, "block_size"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"scheduling": "dynamic"}, "scheduling"),
        ({"kv_cache_bytes": 0}, "kv_cache_bytes"),
        ({"max_model_len": 1}, "max_model_len"),
    ],
)
def test_bad_engine_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**kwargs)


def test_unknown_model_name_or_path():
    with pytest.raises(ValueError, match="unknown model name or path 'no-such-model'"):
        LLM("no-such-model")


def test_max_model_len_beyond_the_model(tiny_llama):
    with pytest.raises(ValueError, match="max_model_len"):
        make_engine(tiny_llama, max_model_len=10_000)


def test_bad_prompts_are_refused_while_the_batch_runs_on(tiny_llama):
    engine = make_engine(tiny_llama, max_model_len=64)
    ref = make_engine(tiny_llama)
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    ref.add_request("good", PROMPT, greedy)
    expected = run_to_completion(ref)["good"].token_ids

    engine.add_request("good", PROMPT, greedy)
    engine.step()
    bad = [
        ([], "prompt must not be empty"),
        ("", "prompt must not be empty"),
        ([1] * 64, "max_model_len"),
        ([5, 100_000], r"prompt token ids must be integers in \[0, 320\)"),
        ([5, -1], "prompt token ids"),
        (["a"], "prompt token ids"),
    ]
    for prompt, message in bad:
        with pytest.raises(ValueError, match=message):
            engine.add_request("bad", prompt, greedy)
    with pytest.raises(ValueError, match="params must be a SamplingParams"):
        engine.add_request("bad", PROMPT, {"max_tokens": 3})
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("good", PROMPT, greedy)
    assert run_to_completion(engine)["good"].token_ids == expected
    assert_no_blocks_used(engine)


def test_llm_generate_names_the_bad_prompt_and_runs_nothing(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", num_kv_blocks=64, block_size=4)
    with pytest.raises(ValueError, match=r"prompts\[1\]: prompt must not be empty"):
        llm.generate([PROMPT, [], PROMPT], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished()
    outs = llm.generate(["Hello world", PROMPT], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [3, 3]
    assert isinstance(outs[0].text, str)


def test_imported_kv_with_a_bad_shape_is_refused(tiny_llama):
    src, dst = make_engine(tiny_llama), make_engine(tiny_llama)
    src.add_prefill("x", PROMPT, SamplingParams(max_tokens=1))
    run_to_completion(src)
    kv = src.export_kv("x")
    blocks = dst.reserve_kv(len(PROMPT))
    with pytest.raises(ValueError, match="kv: expected shape"):
        dst.kv_cache.import_kv(blocks, kv[:1])
    with pytest.raises(ValueError, match="kv: expected shape"):
        dst.kv_cache.import_kv(blocks, kv.half())
    with pytest.raises(ValueError, match="too few"):
        dst.add_prefilled_request("x", PROMPT * 4, [1], SamplingParams(), blocks)
    src.release_kv("x")
    assert_no_blocks_used(src)
    assert_no_blocks_used(dst)  # the refused request's blocks were freed


def test_chat_messages_are_checked(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", num_kv_blocks=64, block_size=4)
    with pytest.raises(ValueError, match=r"messages\[0\] must have a role"):
        llm.chat([{"role": "wizard", "content": "hi"}])
    out = llm.chat([{"role": "user", "content": "Hello world"}], SamplingParams(max_tokens=2))
    assert len(out[0].token_ids) == 2


@pytest.mark.parametrize(
    "key, change, tensor",
    [
        ("intermediate_size", 8, "model.layers.0.mlp.gate_proj.weight"),
        ("num_key_value_heads", -1, "model.layers.0.self_attn.k_proj.weight"),
        ("vocab_size", 5, "model.embed_tokens.weight"),
    ],
)
def test_a_checkpoint_whose_tensors_its_config_does_not_make_is_refused_by_name(
    tiny_llama, tmp_path, key, change, tensor
):
    """Without the check a wider MLP or fewer KV heads in config.json than in the weights would
    load and run, silently another model."""
    import json
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    config = json.loads((model / "config.json").read_text())
    config[key] += change
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"tensor '{tensor}' in .* has shape .*; its config.json makes it"):
        make_engine(model)

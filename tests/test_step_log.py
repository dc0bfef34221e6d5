"""The engine's step log (--step-log): one line per step with what the planner's step line prices."""

from __future__ import annotations

import json
import stat

from conftest import make_engine, run_to_completion

from engine import SamplingParams


def test_step_log_records_each_steps_prefill_chunks_decodes_and_shared_blocks(tiny_llama, tmp_path):
    path = tmp_path / "steps.jsonl"
    engine = make_engine(tiny_llama, step_log=str(path), block_size=4, max_num_batched_tokens=10)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    prefix = list(range(10, 22))  # 12 tokens: three full blocks
    engine.add_request("a", prefix + [30, 31], params)
    run_to_completion(engine)
    engine.add_request("b", prefix + [40, 41], params)  # its prefix cached: 12 tokens
    engine.add_request("c", prefix + [50, 51, 52], params)
    run_to_completion(engine)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    steps = [json.loads(line) for line in path.read_text().splitlines()]
    assert all(s["s"] > 0 and s["t"] > 0 and s["pid"] for s in steps)
    assert [(s["prefills"], s["ending"], s["decodes"]) for s in steps[:4]] == [
        ([[10, 0]], 0, []),  # a's prompt in two chunks (10 tokens a step)
        ([[4, 10]], 1, []),
        ([], 0, [15]),  # its decodes: context 15, then 16
        ([], 0, [16]),
    ]
    later = steps[4:]
    assert later[0]["prefills"] == [[2, 12], [3, 12]] and later[0]["ending"] == 2  # b and c after the cached 12
    # b and c decode together, holding the same three prefix blocks: 3 blocks x 4 tokens shared
    together = [s for s in later if len(s["decodes"]) == 2]
    assert together and all(s["shared"] == 12 for s in together)


def test_step_log_names_a_one_token_chunk_a_prefill_and_each_verification_query_a_decode(tiny_llama, tmp_path):
    """A prompt cached but for its last token is a prefill chunk of one token that ends it, not a
    decode; a sequence verifying d drafts is d + 1 single-token queries, logged as decodes of
    consecutive contexts (as the model runner computes them)."""
    path = tmp_path / "steps.jsonl"
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    engine = make_engine(tiny_llama, step_log=str(path), block_size=4, speculative=spec)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompt = [7, 8, 9, 10] * 3 + [7]  # 13 tokens, repeating: n-gram drafts; 3 full blocks cached for b
    engine.add_request("a", prompt, params)
    run_to_completion(engine)
    engine.add_request("b", prompt, SamplingParams(max_tokens=1, temperature=0))
    run_to_completion(engine)
    steps = [json.loads(line) for line in path.read_text().splitlines()]
    verifying = [s for s in steps if s["drafts"]]
    assert verifying and engine.num_draft_tokens > 0
    for s in verifying:
        first = s["decodes"][0]
        assert s["decodes"] == list(range(first, first + s["drafts"] + 1)) and not s["prefills"]
    assert steps[-1]["prefills"] == [[1, 12]] and steps[-1]["ending"] == 1 and steps[-1]["decodes"] == []


def test_step_log_is_owner_only_even_where_the_file_was_there(tiny_llama, tmp_path):
    path = tmp_path / "steps.jsonl"
    path.write_text("")
    path.chmod(0o644)
    engine = make_engine(tiny_llama, step_log=str(path))
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=2, temperature=0))
    run_to_completion(engine)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(path.read_text().splitlines()) == 2

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

"""Traces (pdserve/trace.py): a Mooncake-format file read and checked, its blocks made into shared
token prefixes, and the simulator replaying its arrivals (`pdserve bench --trace` against a real
cluster is in tests/test_bench.py)."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
from test_planner import hand_profile

from pdserve import trace
from pdserve.cli import parser
from pdserve.plan import profile_file
from pdserve.plan.simulator import Deployment, Simulation, simulate, traced
from serving.launcher import ServerProcess


def write(tmp_path, rows) -> str:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_a_trace_is_read_in_arrival_order_from_its_first_arrival(tmp_path):
    path = write(
        tmp_path,
        [
            {"timestamp": 3000, "input_length": 600, "output_length": 20, "hash_ids": [1, 2]},
            {"timestamp": 1000.5, "input_tokens": 10, "output_tokens": 3},  # the aliases; no blocks
            "",
            {"timestamp": 1000.5, "input_length": 513, "output_length": 1, "hash_ids": [1, 9]},
        ],
    )
    reqs = trace.read(path)
    assert [(r.at_s, r.input_length, r.output_length, r.hash_ids) for r in reqs] == [
        (0.0, 10, 3, ()),
        (0.0, 513, 1, (1, 9)),  # one millisecond: the file's order
        (1.9995, 600, 20, (1, 2)),
    ]
    assert [r.at_s for r in trace.read(path, speedup=2.0)] == [0.0, 0.0, 0.99975]


def test_blocks_are_the_same_tokens_wherever_they_appear_and_the_rest_is_each_requests_own():
    def token(rng: random.Random) -> int:
        return rng.randrange(1, 1 << 30)

    reqs = [trace.TraceRequest(0, n, 1, ids) for n, ids in ((20, (7, 8, 9)), (12, (7, 8)), (30, (7, 5)), (30, (7, 5)))]
    a, b, c, d = trace.prompts(reqs, 8, token)
    assert [len(p) for p in (a, b, c, d)] == [20, 12, 30, 30]
    assert b == a[:12]  # a partial last block: its first tokens
    assert c[:8] == a[:8] and c[8:16] != a[8:16]  # block 7 shared, then block 5
    assert c[:16] == d[:16] and c[16:] != d[16:]  # past their blocks, each its own tokens
    assert trace.prompts(reqs, 8, token) == [a, b, c, d]  # the same seed: the same prompts
    other = trace.prompts(reqs, 8, token, seed=1)  # another run's: its blocks shared alike, no token in common
    assert other[1] == other[0][:12] and other[2][:8] == other[0][:8]
    assert not set(other[0] + other[2]) & set(a + c + d)


@pytest.mark.parametrize(
    "row, says",
    [
        ("{", "trace.jsonl:1: not JSON"),
        ("[1, 2]", "trace.jsonl:1: each line must be a JSON object"),
        ({"input_length": 5, "output_length": 1}, "trace.jsonl:1: timestamp must be a number of milliseconds >= 0"),
        ({"timestamp": -1, "input_length": 5, "output_length": 1}, "timestamp must be a number of milliseconds"),
        ({"timestamp": 0, "input_length": 0, "output_length": 1}, "input_length must be an integer >= 1, got 0"),
        ({"timestamp": 0, "input_length": 5.0, "output_length": 1}, "input_length must be an integer >= 1, got 5.0"),
        ({"timestamp": 0, "input_length": 5, "output_length": True}, "output_length must be an integer >= 1, got True"),
        ('{"timestamp": NaN, "input_length": 5, "output_length": 1}', "timestamp must be a number of milliseconds"),
        ({"timestamp": True, "input_length": 5, "output_length": 1}, "timestamp must be a number of milliseconds"),
        ({"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [True]}, "hash_ids must be a list"),
        ({"timestamp": 0, "input_length": 5}, "output_length must be an integer >= 1, got None"),
        ({"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": "ab"}, "hash_ids must be a list"),
        (
            {"timestamp": 0, "input_length": 513, "output_length": 1, "hash_ids": [1, 2, 3]},
            "3 hash_ids of 512 tokens are more than input_length 513 holds (is --trace-block-tokens",
        ),
        ({"timestamp": 0, "input_length": 5, "output_length": 1, "session_id": "s"}, "session_id (multi-turn"),
    ],
)
def test_a_bad_row_is_named_by_its_line(tmp_path, row, says):
    with pytest.raises(ValueError) as e:
        trace.read(write(tmp_path, [row]))
    assert says in str(e.value)


def test_bad_options_are_named(tmp_path):
    path = write(tmp_path, [{"timestamp": 0, "input_length": 5, "output_length": 1}])
    for kwargs, says in (
        ({"speedup": 0.0}, "--trace-speedup must be a positive number"),
        ({"block_tokens": 0}, "--trace-block-tokens must be >= 1"),
    ):
        with pytest.raises(ValueError, match=says):
            trace.read(path, **kwargs)
    with pytest.raises(ValueError, match="the trace has no requests"):
        trace.read(write(tmp_path, [""]))


def test_the_simulator_sends_a_traces_requests_at_its_times_and_its_shared_blocks_hit_the_cache(tmp_path):
    rows = [{"timestamp": 1000 * k, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]} for k in range(4)] + [
        {"timestamp": 5000, "input_length": 300, "output_length": 8}
    ]
    reqs = trace.read(write(tmp_path, rows), speedup=2.0, block_tokens=256)
    work = traced(reqs, 256)
    sim = Simulation(hand_profile(), Deployment("one", colocated=1), None, None)
    assert sim.run(work).completed == 5
    assert sorted(r.sent for r in sim.records) == [0.0, 0.5, 1.0, 1.5, 2.5]
    assert [r.prompt_tokens for r in sim.records] == [600, 600, 600, 600, 300]
    # the three repeats find the first one's 512 shared tokens (two blocks of 256) in the cache
    assert [r.cached_tokens for r in sim.records] == [0, 512, 512, 512, 0]
    unshared = traced(trace.read(write(tmp_path, [{k: v for k, v in r.items() if k != "hash_ids"} for r in rows])))
    assert simulate(hand_profile(), Deployment("one", colocated=1), unshared).prefix_cache_hit_rate == 0.0


def test_plan_simulate_and_best_take_a_trace(tmp_path, capsys):
    from pdserve.plan.cli import main

    prof = tmp_path / "p.json"
    profile_file.write(hand_profile(), prof)
    path = write(tmp_path, [{"timestamp": 200 * k, "input_length": 100, "output_length": 4} for k in range(6)])
    args = parser().parse_args(["plan", "simulate", "--profile", str(prof), "--colocated", "1", "--trace", path])
    assert main(args) == 0 and "6/6 requests completed" in capsys.readouterr().out
    args = parser().parse_args(["plan", "best", "--profile", str(prof), "--cores", "2", "--trace", path, "--json"])
    assert main(args) == 0
    assert all(d["report"]["completed"] == 6 for d in json.loads(capsys.readouterr().out))
    done = subprocess.run(
        [sys.executable, "-m", "pdserve", "plan", "simulate", "--profile", str(prof), "--trace", path, "--rate", "2"],
        capture_output=True,
        text=True,
    )
    assert done.returncode != 0 and done.stderr.count("\n") == 1
    assert "--trace sets the arrivals and the prompts: leave out --turns, --system-len, --rate and" in done.stderr


def test_a_replay_against_a_server_finds_the_shared_blocks_in_its_prefix_cache(tiny_llama, tmp_path):
    """One engine (pdserve colocated): a prompt behind another that shares its blocks waits for
    them or finds them cached, whatever the timing, so its cached tokens are those blocks'."""
    rows = [(0, 20, 4, [1, 2, 3]), (50, 16, 3, [1, 2]), (100, 30, 5, [1, 2, 4, 5]), (150, 10, 2, [])]
    path = write(
        tmp_path, [{"timestamp": t, "input_length": i, "output_length": o, "hash_ids": h} for t, i, o, h in rows]
    )
    server = ServerProcess(
        ["-m", "pdserve", "colocated", "--model", str(tiny_llama), "--port", "0", "--dtype", "float32"]
        + ["--kv-cache-gb", "0.01", "--block-size", "4", "--num-threads", "1"]
    )
    try:
        address = server.wait_ready()
        out = tmp_path / "bench.json"
        done = subprocess.run(
            [sys.executable, "-m", "pdserve", "bench", "--addr", address, "--quiet", "--json", str(out), "--seed", "3"]
            + ["--trace", path, "--trace-block-tokens", "8"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
        records = sorted(json.loads(out.read_text())["runs"][0]["records"], key=lambda rec: rec["sent"])
    finally:
        server.stop(60)
    assert [(rec["prompt_tokens"], rec["num_tokens"]) for rec in records] == [(i, o) for _, i, o, _ in rows]
    # blocks 1-2: 16 tokens, all of the second prompt (whose last token is computed) and over half
    # of the third (which waits for them if they are being computed, as the engine's rule says)
    assert [rec["cached_tokens"] for rec in records] == [0, 12, 16, 0]

"""pdserve bench: its statistics on a synthetic trace with known answers, and a real run against
`pdserve up` writing JSON and PNGs."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import threading

import pytest

from pdserve.bench_stats import RequestRecord, max_concurrency, percentile, report


def test_percentiles_interpolate_like_numpy():
    xs = [1.0, 2.0, 3.0, 4.0]
    assert percentile(xs, 50) == 2.5
    assert percentile(xs, 100) == 4.0 and percentile(xs, 0) == 1.0
    assert percentile([5.0], 95) == 5.0
    assert math.isnan(percentile([], 50))


def test_report_on_a_known_trace():
    # 4 requests of 11 tokens: TTFT 0.1/0.2/0.3/0.4 s, TPOT 0.01/0.01/0.02/0.05 s; one failure.
    recs = []
    for i, (ttft, tpot) in enumerate([(0.1, 0.01), (0.2, 0.01), (0.3, 0.02), (0.4, 0.05)]):
        sent = i * 1.0
        recs.append(RequestRecord(sent=sent, first_token=sent + ttft, done=sent + ttft + 10 * tpot, num_tokens=11))
    recs.append(RequestRecord(sent=0.5, error="UNAVAILABLE"))
    rep = report(recs, duration_s=4.0, slo_ttft_s=0.35, slo_tpot_s=0.03)
    assert rep.completed == 4 and rep.num_requests == 5 and rep.errors == {"UNAVAILABLE": 1}
    assert rep.ttft_s["mean"] == pytest.approx(0.25) and rep.ttft_s["max"] == pytest.approx(0.4)
    assert rep.ttft_s["p50"] == pytest.approx(0.25)
    assert rep.tpot_s["p50"] == pytest.approx(0.015) and rep.tpot_s["max"] == pytest.approx(0.05)
    assert rep.e2e_s["max"] == pytest.approx(0.4 + 0.5)  # TTFT + TPOT x (n - 1)
    assert rep.tps == pytest.approx(44 / 4.0) and rep.qps == pytest.approx(1.0)
    # Requests 0, 1, 2 meet TTFT <= 0.35 and TPOT <= 0.03; request 3 meets neither.
    assert rep.good_requests == 3 and rep.goodput_rps == pytest.approx(0.75)
    assert rep.goodput_tps == pytest.approx(33 / 4.0)
    strict = report(recs, duration_s=4.0, slo_ttft_s=0.35, slo_tpot_s=0.015)
    assert strict.good_requests == 2


def test_max_concurrency():
    recs = [
        RequestRecord(sent=0, first_token=0.1, done=1.0, num_tokens=2),
        RequestRecord(sent=0.5, first_token=0.6, done=2.0, num_tokens=2),
        RequestRecord(sent=0.9, first_token=1.0, done=1.5, num_tokens=2),
        RequestRecord(sent=1.0, first_token=1.1, done=1.2, num_tokens=2),
    ]  # starts as the first ends
    assert max_concurrency(recs) == 3


def test_bench_end_to_end_against_pdserve_up(tiny_llama, tmp_path):
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdserve",
            "up",
            "--model",
            str(tiny_llama),
            "--port",
            "0",
            "--dtype",
            "float32",
            "--kv-cache-gb",
            "0.01",
            "--block-size",
            "4",
            "--num-threads",
            "1",
            "--log-dir",
            str(tmp_path / "logs"),
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        address = next(line.split()[4] for line in up.stderr if line.startswith("pdserve up: router on "))
        threading.Thread(target=up.stderr.read, daemon=True).start()
        out = tmp_path / "bench.json"
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "pdserve",
                "bench",
                "--addr",
                address,
                "--num-requests",
                "12",
                "--rate",
                "20,60",
                "--prompt-len",
                "uniform:5:40",
                "--output-len",
                "16",
                "--slo-ttft",
                "1",
                "--slo-tpot",
                "0.1",
                "--json",
                str(out),
                "--plot",
                str(tmp_path / "png"),
                "--quiet",
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0, r.stderr
        assert "TTFT" in r.stdout and "goodput" in r.stdout
        data = json.loads(out.read_text())
        assert [run["rate"] for run in data["runs"]] == [20.0, 60.0]
        # Synthetic prompts share no blocks (windows of the repeating filler used to: ~18% cached)
        assert data["runs"][0]["report"]["prefix_cache_hit_rate"] < 0.05
        for run in data["runs"]:
            rep = run["report"]
            assert rep["completed"] == 12 and rep["errors"] == {}
            assert all(rec["num_tokens"] == 16 for rec in run["records"])
            assert 0 < rep["ttft_s"]["p50"] <= rep["ttft_s"]["max"] and rep["tps"] > 0
        for png in ("latency_cdf.png", "rate_sweep.png"):
            assert (tmp_path / "png" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        # A closed loop, with errors counted: max_tokens past the model's context is refused.
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "pdserve",
                "bench",
                "--addr",
                address,
                "--num-requests",
                "4",
                "--concurrency",
                "2",
                "--prompt-len",
                "8",
                "--output-len",
                "5000",
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert "4/4 requests completed" in r.stdout  # generation stops at max_model_len, not an error
        assert "goodput: no SLO given" in r.stdout  # not "goodput (none)"
        assert "| 4/4 [" in r.stderr  # the progress bar ends at its final count, not cleared at 3/4
        seeds = [int(re.search(r"^workload seed (\d+) \(--seed \1 sends the same prompts again\)$", r.stdout, re.M)[1])]
        # Multi-turn: each turn after the previous answer, with the history; the prefix cache hits.
        system = list(range(10, 30))
        dataset = tmp_path / "chats.jsonl"
        dataset.write_text(
            "\n".join(
                [
                    json.dumps([system + [5, 6, 7], [8, 9], [10, 11, 12]]),
                    json.dumps({"turns": [system + [40, 41], {"prompt_token_ids": [42, 43]}, [44]], "max_tokens": 4}),
                    json.dumps({"conversation_id": "c", "turn": 1, "prompt_token_ids": [60, 61]}),
                    json.dumps({"conversation_id": "c", "turn": 0, "prompt_token_ids": system + [50]}),
                ]
            )
        )
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "pdserve",
                "bench",
                "--addr",
                address,
                "--dataset",
                str(dataset),
                "--num-requests",
                "3",
                "--concurrency",
                "1",
                "--output-len",
                "4",
                "--json",
                str(out),
                "--quiet",
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0, r.stderr
        assert "8/8 requests completed" in r.stdout and "prefix cache hit rate" in r.stdout
        seeds.append(json.loads(out.read_text())["args"]["seed"])  # the one drawn, recorded
        assert f"workload seed {seeds[1]} " in r.stdout and seeds[0] != seeds[1]  # a new workload each run
        run = json.loads(out.read_text())["runs"][0]
        prompts = [rec["prompt_tokens"] for rec in run["records"]]
        assert prompts == [23, 23 + 4 + 2, 29 + 4 + 3, 22, 22 + 4 + 2, 28 + 4 + 1, 21, 21 + 4 + 2]
        cached = [rec["cached_tokens"] for rec in run["records"]]
        assert cached[0] == 0 and all(c >= 20 for c in cached[1:])  # the system prompt, then the history
        assert run["report"]["prefix_cache_hit_rate"] > 0.5
        # A trace (Mooncake format): its requests at its times (halved), of its lengths.
        rows = [(0, 20, 4, [1, 2, 3]), (400, 16, 3, [1, 2]), (800, 30, 5, [1, 4]), (1200, 10, 2, [])]
        trace = tmp_path / "trace.jsonl"
        trace.write_text(
            "\n".join(
                json.dumps({"timestamp": t, "input_length": i, "output_length": o, "hash_ids": h})
                for t, i, o, h in reversed(rows)
            )
        )
        r = subprocess.run(
            [sys.executable, "-m", "pdserve", "bench", "--addr", address, "--quiet", "--json", str(out)]
            + ["--trace", str(trace), "--trace-block-tokens", "8", "--trace-speedup", "2"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0, r.stderr
        assert f"[trace {trace}, x2] 4/4 requests completed" in r.stdout
        records = sorted(json.loads(out.read_text())["runs"][0]["records"], key=lambda rec: rec["sent"])
        assert [(rec["prompt_tokens"], rec["num_tokens"]) for rec in records] == [(i, o) for _, i, o, _ in rows]
        assert all(rec["sent"] >= t / 2000 for rec, (t, *_) in zip(records, rows))
        r = subprocess.run(
            [sys.executable, "-m", "pdserve", "bench", "--addr", address, "--trace", str(trace), "--rate", "3"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode != 0 and "--trace sets the arrivals and the prompts: leave out --rate" in r.stderr
        bad = tmp_path / "bad.jsonl"
        bad.write_text(json.dumps({"turns": [[1, 2], ""]}))
        r = subprocess.run(
            [sys.executable, "-m", "pdserve", "bench", "--addr", address, "--dataset", str(bad), "--quiet"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode != 0 and "bad.jsonl:1: each prompt or turn must be non-empty" in r.stderr
    finally:
        up.terminate()
        up.wait(timeout=60)

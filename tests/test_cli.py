"""The pdserve command, run as a user runs it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

HANG_S = 120  # guards against a hang, never a timing
UP = [
    sys.executable,
    "-m",
    "pdserve",
    "up",
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
]


def run(*args):
    return subprocess.run([sys.executable, "-m", "pdserve", *args], capture_output=True, text=True, timeout=300)


def test_generate_offline_prints_the_answer(tiny_llama):
    r = run("generate-offline", "Hello world", "--model", str(tiny_llama), "--max-tokens", "5", "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    assert "5 generated tokens" in r.stderr and "finish: length" in r.stderr


def test_generate_offline_takes_penalties_and_structured_output(tiny_llama):
    model = ["--model", str(tiny_llama), "--dtype", "float32", "--max-tokens", "12"]
    held = ["--choice", "yes", "--choice", "no way", "--presence-penalty", "0.5"]
    r = run("generate-offline", "Hello", *model, *held, "--raw")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() in ("yes", "no way") and "finish: stop" in r.stderr
    r = run("generate-offline", "Hello", *model, "--bad-word", "maybe", "--min-tokens", "3", "--raw")
    assert r.returncode == 0 and int(re.search(r"(\d+) generated tokens", r.stderr)[1]) >= 3, r.stderr
    bad = run("generate-offline", "Hello", *model, "--regex", "(x")
    assert bad.returncode == 1 and "structured_output: the regex is invalid" in bad.stderr, bad.stderr
    bad = run("generate-offline", "Hello", *model, "--min-p", "2")
    assert bad.returncode == 1 and "min_p must be in [0, 1]" in bad.stderr, bad.stderr


def test_generate_offline_names_a_bad_flag_before_it_loads_the_model(tiny_llama, tmp_path, monkeypatch, capsys):
    """An empty --regex or --json-schema is named (never dropped silently), as is a schema file
    that is not UTF-8, and before any weights load."""
    import engine
    from pdserve.cli import main

    def no_load(**_):
        raise AssertionError("the model loaded before the flags were checked")

    monkeypatch.setattr(engine, "LLM", no_load)
    latin = tmp_path / "schema.json"
    latin.write_bytes(b'{"title": "caf\xe9"}')
    empty = tmp_path / "empty.json"
    empty.write_text("")
    cases = [
        (["--regex", ""], "a regex needs its spec"),
        (["--json-schema", str(empty)], "a json_schema needs its spec"),
        (["--json-schema", str(latin)], "is not UTF-8 text"),
        (["--temperature", "-1"], "temperature must be >= 0"),
    ]
    for flags, message in cases:
        try:
            code = main(["generate-offline", "Hello", "--model", str(tiny_llama), *flags])
        except SystemExit as e:
            code, err = 1, str(e)
        else:
            err = capsys.readouterr().err
        assert code == 1 and message in err, (flags, err)


def test_generate_offline_reports_bad_input():
    r = run("generate-offline", "Hello", "--model", "nope")
    assert r.returncode == 2
    assert "unknown model name or path 'nope'" in r.stderr
    r = run("generate-offline", "Hello", "--model", "nope", "--cpus", "4096")
    assert r.returncode == 2 and "--cpus '4096': not cores of this machine" in r.stderr, r.stderr


def test_generate_offline_runs_on_the_cores_it_is_given(tiny_llama):
    """--cpus pins the engine's process (it was accepted and ignored)."""
    core = max(os.sched_getaffinity(0))
    script = (
        "import os, sys; from pdserve.cli import main; code = main(sys.argv[1:]); "
        "print('cores', sorted(os.sched_getaffinity(0))); sys.exit(code)"
    )
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            script,
            "generate-offline",
            "Hello",
            "--model",
            str(tiny_llama),
            "--max-tokens",
            "2",
            "--dtype",
            "float32",
            "--cpus",
            str(core),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert f"cores [{core}]" in r.stdout


def test_up_then_generate_streams_and_stops_cleanly(tiny_llama, tmp_path):
    """`pdserve up` starts real node processes; `pdserve generate` asks it; SIGTERM stops them all."""
    import json
    import threading

    import psutil
    from conftest import make_engine, run_to_completion

    from engine import SamplingParams
    from engine.structured_output import StructuredOutput
    from engine.tokenizer import bad_words_token_ids

    speculative = '{"method": "ngram", "num_speculative_tokens": 4}'
    core = max(os.sched_getaffinity(0))  # --cpus: the router and every node on this core only
    up = subprocess.Popen(
        [
            *UP,
            "--model",
            str(tiny_llama),
            "--log-dir",
            str(tmp_path),
            "--cpus",
            str(core),
            "--pin-cpus",
            "--speculative-config",
            speculative,
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        address, node_lines = None, []
        for line in up.stderr:
            node_lines += re.findall(
                r"^pdserve up: (\w+) node 0 on (\S+), pid (\d+), ready in [\d.]+ s, log (\S+)$", line
            )
            if line.startswith("pdserve up: router on "):
                address = line.split()[4]
                break
        assert address, "pdserve up did not come up"
        threading.Thread(target=up.stderr.read, daemon=True).start()  # keep the pipe drained
        children = psutil.Process(up.pid).children(recursive=True)
        assert len(children) == 2
        assert {role for role, *_ in node_lines} == {"prefill", "decode"}
        assert {int(pid) for _, _, pid, _ in node_lines} == {c.pid for c in children}
        assert all(Path(log).is_file() for *_, log in node_lines)
        for child in children:  # the engine settings reach every node process
            cmd = child.cmdline()
            assert json.loads(cmd[cmd.index("--speculative-config") + 1]) == json.loads(speculative)
        assert [os.sched_getaffinity(p.pid) for p in [psutil.Process(up.pid), *children]] == [{core}] * 3
        r = run(
            "generate", "--addr", address, "--json", "--raw", "--max-tokens", "8", "--temperature", "0", "Hello world"
        )
        assert r.returncode == 0, r.stderr
        result = json.loads(r.stdout.strip().splitlines()[-1])
        engine = make_engine(tiny_llama)
        engine.add_request("x", "Hello world", SamplingParams(max_tokens=8, temperature=0))
        assert result["token_ids"] == run_to_completion(engine)["x"].token_ids
        assert result["usage"]["completion_tokens"] == len(result["token_ids"])
        assert result["timings"]["kv_transport"] == "shm"  # two processes, one host: the one-sided read
        bad = run("generate", "--addr", address, "--max-tokens", "0", "hi")
        assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr and "max_tokens" in bad.stderr
        # penalties and a bad word, then a regex: over the wire, the tokens one engine gives the same parameters
        tok, regex = engine.tokenizer, "[a-z ]{4,12}"
        for i, (flags, params) in enumerate(
            [
                (
                    ["--presence-penalty", "1.5", "--repetition-penalty", "1.3", "--bad-word", "lo"],
                    dict(
                        presence_penalty=1.5,
                        repetition_penalty=1.3,
                        bad_words_token_ids=bad_words_token_ids(tok, ["lo"]),
                    ),
                ),
                (
                    ["--regex", regex, "--min-p", "0.1"],
                    dict(structured_output=StructuredOutput("regex", regex), min_p=0.1),
                ),
            ]
        ):
            r = run("generate", "--addr", address, "--json", "--raw", "--max-tokens", "16", *flags, "Hello world")
            assert r.returncode == 0, r.stderr
            got = json.loads(r.stdout.strip().splitlines()[-1])
            engine.add_request(str(i), "Hello world", SamplingParams(max_tokens=16, temperature=0, **params))
            assert got["token_ids"] == run_to_completion(engine)[str(i)].token_ids, flags
        assert got["finish_reason"] == "length" or re.fullmatch(regex, got["text"]), got
    finally:
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 0
    assert not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children)
    pids = {str(c.pid) for c in children}
    assert not [p for p in Path("/dev/shm").glob("pdserve-kv-*") if p.name.split("-")[2] in pids]


COMMANDS = [
    ["-m", "pdserve", "up"],
    ["-m", "pdserve", "serve"],
    ["-m", "pdserve", "bench"],
    ["-m", "pdserve", "generate"],
    ["-m", "pdserve", "generate-offline"],
    ["-m", "prefill_node"],
    ["-m", "decode_node"],
    ["-m", "router"],
    ["-m", "pdserve", "colocated"],
    ["-m", "pdserve", "plan", "memory"],
    [str(Path(__file__).resolve().parents[1] / "benchmarks" / "kv_transfer.py")],
]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c).rsplit("/", 1)[-1])
def test_help_shows_every_default(command):
    r = subprocess.run(
        [sys.executable, *command, "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert r.returncode == 0, r.stderr
    options, block = [], None
    for line in r.stdout.splitlines():  # an option's block: its "  --flag" line and the indented lines after it
        if line.startswith("  -"):
            block = [line]
            options.append(block)
        elif line.startswith("   ") and block is not None:
            block.append(line)
        else:
            block = None
    assert len(options) > 3
    undocumented = [
        b[0].split()[0]
        for b in options
        if not b[0].startswith("  -h,") and not re.search(r"\((default: .+|required)\)", " ".join(b))
    ]
    assert not undocumented, r.stdout
    if command[-1].startswith("generate"):
        assert "greedy (temperature 0) unless --temperature is given" in " ".join(r.stdout.split())
    if "--dtype {auto," in r.stdout:  # wherever auto is offered, it is explained
        assert (
            "auto: bfloat16 on CUDA and on CPUs with native bf16 (AMX or AVX512_BF16), float32 on other CPUs"
            in " ".join(r.stdout.split())
        )


def test_generate_puts_an_error_after_streamed_text_on_its_own_line(tiny_llama):
    """A deadline that passes mid-answer: the tokens so far are printed, then the error on its own line."""
    import asyncio

    from cluster import local_cluster
    from test_cluster import slow_layers

    async def scenario():
        async with local_cluster(tiny_llama) as (router, prefills, decodes):
            slow_layers(decodes[0], 0.05)  # 0.1 s a token
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "pdserve",
                "generate",
                "--addr",
                router.address,
                "--raw",
                "--max-tokens",
                "500",
                "--timeout",
                "3",
                "Hello world",
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            out, err = await asyncio.wait_for(proc.communicate(), 120)
            return proc.returncode, out.decode(), err.decode()

    code, out, err = asyncio.run(scenario())
    assert code == 1
    assert out.strip() and out.endswith("\n")  # the tokens so far, then a newline before the error
    assert err.count("\n") == 1 and err.startswith("pdserve: error: DEADLINE_EXCEEDED"), err


def test_generate_without_a_healthy_decode_node_fails_before_any_prefill(tiny_llama):
    """The router picks the decode node first: with none healthy, the request fails at once."""
    import asyncio

    from cluster import local_cluster

    async def scenario():
        async with local_cluster(tiny_llama) as (router, prefills, decodes):
            await decodes[0].server.set_serving(False)
            while router.decode_pool.healthy():
                await asyncio.sleep(0.05)
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "pdserve",
                "generate",
                "--addr",
                router.address,
                "--raw",
                "--max-tokens",
                "8",
                "Hello world",
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            out, err = await asyncio.wait_for(proc.communicate(), 120)
            return proc.returncode, out.decode(), err.decode(), prefills[0].num_prefilled

    code, out, err, prefilled = asyncio.run(scenario())
    assert code == 1 and out == "" and prefilled == 0
    assert err.count("\n") == 1 and err.startswith("pdserve: error: UNAVAILABLE: no healthy decode node (of 1: "), err


TOO_SMALL = ["--kv-cache-gb", "0.0000001"]  # a valid option, but not one KV block of the model: its node fails


def test_up_says_in_one_line_why_a_node_did_not_start(tiny_llama, tmp_path):
    r = subprocess.run(
        [*UP, "--model", str(tiny_llama), *TOO_SMALL, "--log-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 1
    assert "Traceback" not in r.stderr  # that stays in the node's log
    first, line = r.stderr.splitlines()  # what starts, then why it stopped
    assert first.startswith(f"pdserve up: model {tiny_llama}: starting 1 prefill + 1 decode node processes")
    assert re.fullmatch(
        r"pdserve up: error: (prefill|decode) node 0 \(pid \d+\) exited with code 1 before it was "
        r"ready: ValueError: kv_cache_bytes must hold at least one block of \d+ bytes, got 107 \(log: \S+\.log\)",
        line,
    ), line
    log = Path(line.rsplit("(log: ", 1)[1].rstrip(")"))
    assert log.parent == tmp_path and "Traceback" in log.read_text()


@pytest.mark.parametrize(
    "flag, value, error",
    [
        ("--max-num-seqs", "0", "max_num_seqs must be >= 1, got 0"),
        ("--speculative-config", '{"k": 4}', "speculative: unknown setting(s) ['k']"),
        ("--rate-limit", "0", "rate_limit must be > 0 requests/s, got 0.0"),
        ("--decode", "0", "decode must be >= 1, got 0"),
    ],
)
def test_up_refuses_a_bad_option_before_starting_anything(tiny_llama, tmp_path, flag, value, error):
    """Each option is checked by its component's config in `pdserve up` itself: one line naming the
    setting, exit 2, no node started."""
    r = subprocess.run(
        [*UP, "--model", str(tiny_llama), "--log-dir", str(tmp_path / "logs"), flag, value],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2 and r.stderr.startswith(f"pdserve: error: {error}") and r.stderr.count("\n") == 1
    assert not (tmp_path / "logs").exists()


def test_up_pin_gpus_gives_each_node_its_own_gpu_round_robin(monkeypatch, tmp_path):
    """--pin-gpus: each node process gets one visible GPU through its CUDA_VISIBLE_DEVICES, in
    node order, round robin; with none visible, one line before anything starts."""
    from pdserve.cli import parser
    from pdserve.up import Spawner

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3, 5,-1,7")  # CUDA stops at the invalid entry
    args = parser().parse_args(["up", "--prefill", "1", "--decode", "2", "--pin-gpus", "--device", "cuda"])
    spawner = Spawner(args, tmp_path)
    gpus = [spawner.env(role, i).get("CUDA_VISIBLE_DEVICES") for role, i in spawner.slots]
    assert gpus == ["3", "5", "3"]
    assert "CUDA_VISIBLE_DEVICES" not in Spawner(parser().parse_args(["up"]), tmp_path).env("decode", 0)
    for device, error in (
        ("cuda", "--pin-gpus: no GPU is visible here (CUDA_VISIBLE_DEVICES, torch.cuda)"),
        ("cuda:1", "--pin-gpus needs --device cuda (each node sees its own GPU as cuda:0), got cuda:1"),
    ):
        r = subprocess.run(
            [*UP, "--log-dir", str(tmp_path / "logs"), "--pin-gpus", "--device", device],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
        )
        assert r.returncode == 2 and r.stderr == f"pdserve: error: {error}\n"
        assert not (tmp_path / "logs").exists()


@pytest.mark.parametrize(
    "flag, host", [("--port", "127.0.0.1"), ("--http-port", "127.0.0.1"), ("--metrics-port", "0.0.0.0")]
)
def test_up_says_in_one_line_that_a_port_is_taken_before_starting_a_node(tiny_llama, tmp_path, flag, host):
    import socket

    with socket.create_server((host, 0)) as taken:
        port = str(taken.getsockname()[1])
        r = subprocess.run(
            [*UP, "--model", str(tiny_llama), "--log-dir", str(tmp_path / "logs"), flag, port],
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert r.returncode == 1
    assert r.stderr == f"pdserve up: error: could not bind {host}:{port} ({flag}): Address already in use\n"
    assert not (tmp_path / "logs").exists()  # no node was started
    both = subprocess.run(
        [*UP[:4], "--port", "8123", "--http-port", "8123"], capture_output=True, text=True, timeout=300
    )
    assert both.returncode == 1 and both.stderr == "pdserve up: error: --port and --http-port both need port 8123\n"


def start_up(model, *flags) -> tuple[subprocess.Popen, dict, str]:
    """`pdserve up` with two decode nodes; (process, node name -> pid, router address) once it is up."""
    up = subprocess.Popen([*UP, "--model", str(model), "--decode", "2", *flags], stderr=subprocess.PIPE, text=True)
    pids, address = {}, None
    for line in up.stderr:
        pids.update(
            {role: int(pid) for role, pid in re.findall(r"^pdserve up: (\w+ node \d+) on \S+, pid (\d+)", line)}
        )
        if line.startswith("pdserve up: router on "):
            address = line.split()[4]
            break
    assert set(pids) == {"prefill node 0", "decode node 0", "decode node 1"}
    return up, pids, address


def assert_gone(pids) -> None:
    import psutil

    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)


def stop_all(up: subprocess.Popen, pids: dict) -> None:
    """After a failed test too: `pdserve up` stopped (SIGTERM stops its nodes), then any node left, by PID."""
    import psutil

    if up.poll() is None:
        up.terminate()
        try:
            up.wait(timeout=60)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait()
    for pid in pids.values():
        if psutil.pid_exists(pid):
            os.kill(pid, signal.SIGKILL)


class Lines:
    """`pdserve up`'s stderr read to the end in a thread (a full pipe would block it), each line
    kept; next(prefix) waits for the next one that starts with prefix."""

    def __init__(self, up: subprocess.Popen):
        import queue
        import threading

        self.all: list[str] = []
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, args=(up,), daemon=True).start()

    def _read(self, up) -> None:
        for line in up.stderr:
            self.all.append(line)
            self._queue.put(line)
        self._queue.put("")

    def next(self, prefix: str, timeout_s: float = 300) -> str:
        deadline = time.monotonic() + timeout_s
        while (line := self._queue.get(timeout=max(0.0, deadline - time.monotonic()))) and not line.startswith(prefix):
            pass
        return line

    def tail(self, n: int = 40) -> str:
        return "".join(self.all[-n:])


def test_up_restarts_a_node_that_exits_and_keeps_serving(tiny_llama, tmp_path):
    """kill -9 of one of two decode nodes: the stream on it migrates and finishes, the others keep
    serving, the node comes back (a new process, its log appended) and serves again; SIGTERM then
    stops everything. (pdserve up used to stop the whole cluster.)"""
    import threading

    import psutil

    from router.client import Client

    up, pids, address = start_up(tiny_llama, "--log-dir", str(tmp_path))
    lines = Lines(up)
    try:
        # two long streams in flight (one on each decode node) while decode node 1 dies
        counts, errors = [0, 0], []

        def stream(i):
            try:
                with Client(address) as client:
                    for part in client.stream([5 + i, 6, 7], max_tokens=300, temperature=0, ignore_eos=True):
                        counts[i] += len(part.token_ids)
            except Exception as e:  # noqa: BLE001 - recorded, asserted below
                errors.append(e)

        streams = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
        for t in streams:
            t.start()
        while min(counts) < 10 and not errors and any(t.is_alive() for t in streams):
            time.sleep(0.005)
        os.kill(pids["decode node 1"], signal.SIGKILL)
        line = lines.next("pdserve up: decode node 1 ")
        assert re.fullmatch(
            rf"pdserve up: decode node 1 \(pid {pids['decode node 1']}, \S+\) exited with code -9 "
            r"\(SIGKILL\) \(log: \S+\); the other nodes keep serving, restarting it in 1 s\n",
            line,
        ), line
        for t in streams:
            t.join(timeout=300)
        print(lines.tail())
        assert not errors and counts == [300, 300], (errors, counts)
        assert run("generate", "--addr", address, "--max-tokens", "4", "hi").returncode == 0  # meanwhile
        back = re.match(r"pdserve up: decode node 1 on \S+, pid (\d+), ready in", lines.next("pdserve up: "))
        assert back and int(back[1]) != pids["decode node 1"] and psutil.pid_exists(int(back[1]))
        pids["decode node 1 again"] = int(back[1])
        for _ in range(4):  # both decode nodes serve again
            assert run("generate", "--addr", address, "--max-tokens", "4", "hi").returncode == 0
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 0
        assert_gone(pids.values())
    finally:
        stop_all(up, pids)


def test_nodes_exit_when_pdserve_up_is_killed(tiny_llama, tmp_path):
    """kill -9 of `pdserve up` itself (the OOM killer, a lost terminal): its nodes notice within
    seconds and exit, ports and KV memory freed, rather than run on orphaned (they used to)."""
    import psutil

    up, pids, _ = start_up(tiny_llama, "--log-dir", str(tmp_path))
    try:
        up.kill()
        up.wait()
        deadline = time.monotonic() + HANG_S
        while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids.values()):
            assert time.monotonic() < deadline, "nodes still running after pdserve up was killed"
            time.sleep(0.1)
        for role in ("prefill-0", "decode-0", "decode-1"):
            assert "pdserve up (pid" in (tmp_path / f"{role}.log").read_text(), role
    finally:
        stop_all(up, pids)


def test_up_stops_everything_and_exits_1_when_a_node_exits_past_its_restarts(tiny_llama, tmp_path):
    up, pids, _ = start_up(tiny_llama, "--log-dir", str(tmp_path), "--node-restarts", "0")
    try:
        os.kill(pids["decode node 1"], signal.SIGKILL)
        assert up.wait(timeout=60) == 1
        last = up.stderr.read().strip().splitlines()[-1]
        assert re.fullmatch(
            rf"pdserve up: decode node 1 \(pid {pids['decode node 1']}, \S+\) exited with code -9 "
            r"\(SIGKILL\) \(log: \S+\); 1 exit in 300 s \(--node-restarts 0\): stopping the others",
            last,
        ), last
        assert_gone(pids.values())
    finally:
        stop_all(up, pids)


def test_version_and_one_line_client_errors(tmp_path):
    from importlib.metadata import version

    r = run("--version")
    assert r.returncode == 0 and r.stdout == f"pdserve {version('pdserve')}\n"
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}"
    for args in (["bench", "--addr", closed, "--num-requests", "1", "--quiet"], ["generate", "--addr", closed, "hi"]):
        r = run(*args)
        assert r.returncode == 1, r
        assert r.stderr.startswith("pdserve: error: UNAVAILABLE: ") and r.stderr.count("\n") == 1, r.stderr
    r = run("bench", "--addr", closed, "--dataset", str(tmp_path / "missing.jsonl"))
    assert (r.returncode, r.stderr) == (1, f"pdserve: error: {tmp_path / 'missing.jsonl'}: No such file or directory\n")
    r = run("generate", "--addr", closed, "--api-key-file", str(tmp_path / "none"), "hi")
    assert r.returncode == 2 and r.stderr.startswith("pdserve: error: cannot read the API key file "), r.stderr


def test_up_removes_its_temporary_log_dir_and_keeps_it_when_a_node_fails(tiny_llama, tmp_path):
    """Without --log-dir the logs go to a new owner-only temporary directory: gone after a clean
    stop, kept (and named) when a node failed."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    ok = subprocess.run(
        [*UP, "--model", str(tiny_llama), "--ask", "Hi", "--max-tokens", "2"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert ok.returncode == 0, ok.stderr
    made = re.search(r"logs in (\S+) \(removed at exit unless a node fails\)", ok.stderr).group(1)
    assert Path(made).parent == tmp_path and not Path(made).exists()
    bad = subprocess.run(
        [*UP, "--model", str(tiny_llama), *TOO_SMALL], capture_output=True, text=True, timeout=300, env=env
    )
    assert bad.returncode == 1
    kept = Path(re.search(r"\(log: (\S+)\)$", bad.stderr.splitlines()[-1]).group(1)).parent
    assert kept.parent == tmp_path and (kept.stat().st_mode & 0o777) == 0o700
    assert {p.name for p in kept.iterdir()} == {"prefill-0.log", "decode-0.log"}
    assert all((p.stat().st_mode & 0o777) == 0o600 for p in kept.iterdir())

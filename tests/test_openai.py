"""The OpenAI-compatible HTTP API, driven by the official `openai` package and a plain HTTP
client, against `pdserve up` with the tiny model."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import subprocess
import sys
import threading

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router.client import Client

PROMPT_IDS = [5, 17, 33, 8, 90, 41, 7]
KEY, OTHER_KEY = "sk-test-1", "sk-test-2"  # the keys file of `up`


@pytest.fixture(scope="module")
def up(tiny_llama, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text(f"{KEY}\n\n{OTHER_KEY}\n")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdserve",
            "up",
            "--model",
            str(tiny_llama),
            "--port",
            "0",
            "--http-port",
            "0",
            "--api-key-file",
            str(keys),
            "--dtype",
            "float32",
            "--kv-cache-gb",
            "0.01",
            "--block-size",
            "4",
            "--num-threads",
            "1",
            "--log-dir",
            str(tmp_path_factory.mktemp("logs")),
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    http = grpc = None
    for line in proc.stderr:
        if "OpenAI-compatible HTTP API on" in line:
            http = line.split("on ")[-1].strip()
        if line.startswith("pdserve up: router on "):
            grpc = line.split()[4]
            break
    threading.Thread(target=proc.stderr.read, daemon=True).start()
    assert http and grpc, "pdserve up did not come up"
    yield http, grpc, str(tiny_llama), keys
    proc.terminate()
    proc.wait(timeout=60)


@pytest.fixture
def client(up):
    return openai.OpenAI(base_url=up[0], api_key=KEY, max_retries=0)


def test_completions_equal_the_grpc_path(up, client):
    _, grpc_addr, model, _ = up
    expected = Client(grpc_addr, api_key=KEY).generate(PROMPT_IDS, max_tokens=12, temperature=0, ignore_eos=True)
    result = client.completions.create(
        model=model, prompt=PROMPT_IDS, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert result.choices[0].text == expected.text
    assert result.usage.prompt_tokens == len(PROMPT_IDS) and result.usage.completion_tokens == 12
    assert result.usage.total_tokens == len(PROMPT_IDS) + 12
    assert result.choices[0].finish_reason == "length" and result.object == "text_completion"
    streamed = client.completions.create(
        model=model,
        prompt=PROMPT_IDS,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert chunks[-1].usage.completion_tokens == 12


def test_penalties_bias_and_bad_words_equal_the_grpc_path(up, client):
    """OpenAI's presence/frequency penalties and logit_bias (string keys), vLLM's
    repetition_penalty, min_p, min_tokens and bad_words (strings the router tokenizes)."""
    _, grpc_addr, model, _ = up
    plain = client.completions.create(model=model, prompt=PROMPT_IDS, max_tokens=12, temperature=0)
    word = plain.choices[0].text.split()[0]
    sampling = dict(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.25, min_p=0.25, min_tokens=3)
    expected = Client(grpc_addr, api_key=KEY).generate(
        PROMPT_IDS, max_tokens=12, temperature=0, ignore_eos=True, logit_bias={7: 2.0}, bad_words=[word], **sampling
    )
    result = client.completions.create(
        model=model,
        prompt=PROMPT_IDS,
        max_tokens=12,
        temperature=0,
        presence_penalty=1.5,
        frequency_penalty=0.5,
        logit_bias={"7": 2.0},
        extra_body={"ignore_eos": True, "bad_words": [word], **{k: sampling[k] for k in sampling if "ence" not in k}},
    )
    assert result.choices[0].text == expected.text != plain.choices[0].text
    assert word not in result.choices[0].text.split()


@pytest.mark.parametrize(
    "extra, param, words",
    [
        (dict(presence_penalty=3), "presence_penalty", "presence_penalty must be in [-2, 2], got 3.0"),
        (dict(logit_bias={"x": 1}), "logit_bias", "'x' is not a token id"),
        (dict(logit_bias={"7": 500}), "logit_bias", "each biased by [-100, 100]"),
        (dict(logit_bias={"99999": 1}), "logit_bias", "below the vocabulary size 320"),
        (dict(bad_words="no"), "bad_words", "bad_words must be a list of strings"),
        (dict(bad_words=[f"w{i}" for i in range(257)]), "bad_words", "bad_words: at most 256 words, got 257"),
        (dict(min_tokens=20, max_tokens=5), "min_tokens", "min_tokens must be in [0, max_tokens 5], got 20"),
    ],
)
def test_bad_penalties_are_400_naming_the_field(up, client, extra, param, words):
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(model=up[2], prompt="hi", max_tokens=3, extra_body=extra)
    body = err.value.response.json()["error"]
    assert err.value.status_code == 400 and words in body["message"] and body["param"] == param


SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["small", "large"]}},
    "required": ["ok", "size"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("temperature", [0, 1.0])
def test_response_format_json_schema_validates(up, client, stream, temperature):
    """OpenAI's response_format through chat, greedy and sampled, streamed and not: the answer
    (ended by the model, not by max_tokens) validates against its schema."""
    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA, "strict": True}}
    kwargs = dict(model=up[2], messages=[{"role": "user", "content": "Hi"}], max_tokens=60, seed=4)
    reply = client.chat.completions.create(**kwargs, temperature=temperature, response_format=fmt, stream=stream)
    if stream:
        chunks = list(reply)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason][-1]
    else:
        text, finish = reply.choices[0].message.content, reply.choices[0].finish_reason
    assert finish == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


def test_vllms_structured_outputs_and_guided_fields(up, client):
    kwargs = dict(model=up[2], prompt=PROMPT_IDS, max_tokens=30, temperature=0)
    choice = client.completions.create(**kwargs, extra_body={"structured_outputs": {"choice": ["yes", "no way"]}})
    assert choice.choices[0].text in ("yes", "no way")
    regex = client.completions.create(**kwargs, extra_body={"guided_regex": "[a-z]{3}-[0-9]{2}"})
    assert re.fullmatch("[a-z]{3}-[0-9]{2}", regex.choices[0].text)
    obj = client.completions.create(**kwargs, extra_body={"response_format": {"type": "json_object"}})
    assert obj.choices[0].finish_reason == "length" or isinstance(json.loads(obj.choices[0].text), dict)


@pytest.mark.parametrize(
    "extra, param, words",
    [
        (dict(response_format={"type": "xml"}), "response_format", "response_format.type must be text, json_object"),
        (
            dict(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "objectx"}}}),
            "response_format",
            "the json_schema is invalid: Invalid type: objectx",
        ),
        (dict(guided_regex="(x"), "guided_regex", "the regex is invalid"),
        (dict(guided_regex="a", guided_choice=["a"]), "guided_choice", "only one structured output per request"),
        (dict(structured_outputs={"grammar": "start: foo"}), "structured_outputs", 'unknown name: "foo"'),
        (dict(structured_outputs={"structural_tag": "x"}), "structured_outputs", "['structural_tag'] not supported"),
    ],
)
def test_bad_structured_outputs_are_400_naming_the_field(up, client, extra, param, words):
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(model=up[2], prompt="hi", max_tokens=3, extra_body=extra)
    body = err.value.response.json()["error"]
    assert err.value.status_code == 400 and words in body["message"], body
    assert body["param"] == param


def test_chat_equals_the_grpc_path(up, client):
    _, grpc_addr, model, _ = up
    messages = [{"role": "user", "content": "Hello world"}]
    expected = Client(grpc_addr, api_key=KEY).generate(messages=messages, max_tokens=10, temperature=0, ignore_eos=True)
    result = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True},
        logprobs=True,
        top_logprobs=2,
    )
    assert result.choices[0].message.role == "assistant"
    assert result.choices[0].message.content == expected.text
    assert result.usage.completion_tokens == 10 and result.object == "chat.completion"
    assert len(result.choices[0].logprobs.content) == 10
    assert all(len(c.top_logprobs) >= 2 for c in result.choices[0].logprobs.content)
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=10, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_max_tokens_defaults_as_in_openai(up, client):
    """Chat without max_tokens runs to the end of the context (OpenAI's default), not 16 tokens;
    the legacy completions endpoint keeps OpenAI's 16."""
    model = up[2]
    max_model_len = client.models.list().data[0].max_model_len
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hello world"}],
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage.completion_tokens == max_model_len - chat.usage.prompt_tokens > 16
    completion = client.completions.create(
        model=model, prompt=PROMPT_IDS, temperature=0, extra_body={"ignore_eos": True}
    )
    assert completion.usage.completion_tokens == 16 and completion.choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    "options", [{"include_usage": True, "continuous_usage_stats": True}, {"continuous_usage_stats": True}]
)
def test_continuous_usage_stats_on_every_chunk(up, client, options):
    """vLLM's extension: every chunk carries the usage so far (here it implies include_usage)."""
    model = up[2]
    chunks = list(
        client.completions.create(
            model=model,
            prompt=PROMPT_IDS,
            max_tokens=6,
            logprobs=1,
            stream=True,
            stream_options=options,
            extra_body={"ignore_eos": True},
        )
    )
    streamed = 0
    for chunk in chunks[:-1]:
        streamed += len(chunk.choices[0].logprobs.tokens)
        assert (chunk.usage.prompt_tokens, chunk.usage.completion_tokens) == (len(PROMPT_IDS), streamed)
        assert chunk.usage.total_tokens == len(PROMPT_IDS) + streamed
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == streamed == 6
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens is not None
    chat = list(
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=3,
            stream=True,
            stream_options=options,
            extra_body={"ignore_eos": True},
        )
    )
    assert chat[0].choices[0].delta.role == "assistant" and chat[0].usage.completion_tokens == 0
    assert all(c.usage.prompt_tokens == chat[-1].usage.prompt_tokens > 0 for c in chat)
    counts = [c.usage.completion_tokens for c in chat]
    assert counts == sorted(counts) and counts[-1] == 3


def test_models_and_health(up, client):
    assert [m.id for m in client.models.list()] == [up[2]]
    assert httpx.get(f"{up[0].removesuffix('/v1')}/health").json()["status"] == "ok"


def test_sse_framing_with_a_plain_http_client(up):
    http, _, model, _ = up
    body = {"model": model, "prompt": PROMPT_IDS, "max_tokens": 5, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{http}/completions", json=body, headers={"Authorization": "Bearer sk-test-2"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = "".join(r.iter_text())
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"
    assert all(p["object"] == "text_completion" for p in payloads)


@pytest.mark.parametrize(
    "kwargs, status, words, param",
    [
        (dict(prompt="hi", max_tokens=0), 400, "max_tokens", "max_tokens"),
        (dict(prompt="hi", temperature=-1), 400, "temperature", "temperature"),
        (dict(prompt="hi", top_p=1.5), 400, "top_p", "top_p"),
        (dict(prompt="", max_tokens=3), 400, "prompt", "prompt"),
        (dict(prompt="hi", n=17), 400, "n must be an integer in [1, 16]", "n"),
        (dict(prompt="hi", n=2, best_of=3, stream=True), 400, "best_of must equal n when streaming", "best_of"),
        (dict(prompt="hi", n=3, best_of=2), 400, "best_of must be", "best_of"),
        (dict(prompt="hi", model="gpt-17"), 404, "gpt-17", "model"),
        (
            dict(prompt="hi", stream_options={"include_usage": True}),
            400,
            "stream_options is only allowed when stream",
            "stream_options",
        ),
        (
            dict(prompt="hi", stream=True, stream_options={"continuous_usage_stats": 1}),
            400,
            "stream_options.continuous_usage_stats must be a boolean",
            "stream_options.continuous_usage_stats",
        ),
    ],
)
def test_errors_in_openai_shape(up, client, kwargs, status, words, param):
    kwargs.setdefault("model", up[2])
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(**kwargs)
    assert err.value.status_code == status
    body = err.value.response.json()["error"]
    assert words in body["message"] and body["type"] == "invalid_request_error" and body["param"] == param
    assert body["code"] == ("model_not_found" if status == 404 else None)


def test_n_choices_equal_the_grpc_samples(up, client):
    _, grpc_addr, model, _ = up
    sampling = dict(max_tokens=8, temperature=1.0, seed=7)
    expected = Client(grpc_addr, api_key=KEY).generate(PROMPT_IDS, n=3, ignore_eos=True, **sampling)
    result = client.completions.create(model=model, prompt=PROMPT_IDS, n=3, extra_body={"ignore_eos": True}, **sampling)
    assert [c.index for c in result.choices] == [0, 1, 2]
    assert [c.text for c in result.choices] == [s.text for s in expected.samples]
    assert len({c.text for c in result.choices}) > 1 and result.usage.completion_tokens == 24
    # Streaming: every chunk names its choice, each choice ends once, the texts are the same.
    texts, ends = ["", "", ""], [0, 0, 0]
    for chunk in client.completions.create(
        model=model, prompt=PROMPT_IDS, n=3, stream=True, extra_body={"ignore_eos": True}, **sampling
    ):
        for c in chunk.choices:
            texts[c.index] += c.text
            ends[c.index] += c.finish_reason is not None
    assert texts == [s.text for s in expected.samples] and ends == [1, 1, 1]
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], n=2, **sampling)
    assert [c.index for c in chat.choices] == [0, 1] and all(c.message.role == "assistant" for c in chat.choices)
    best = client.completions.create(
        model=model, prompt=PROMPT_IDS, n=1, extra_body={"best_of": 3, "ignore_eos": True}, **sampling
    )
    assert len(best.choices) == 1 and best.usage.completion_tokens == 8
    # vLLM's beam search extension: best_of beams, the n best returned, as over gRPC
    beams = client.completions.create(
        model=model,
        prompt=PROMPT_IDS,
        n=2,
        max_tokens=8,
        temperature=0,
        extra_body={"use_beam_search": True, "best_of": 3},
    )
    expected = Client(grpc_addr, api_key=KEY).generate(PROMPT_IDS, n=2, beam_width=3, max_tokens=8)
    assert [c.text for c in beams.choices] == [s.text for s in expected.samples[:2]] and len(expected.samples) == 3
    streamed = ["", ""]
    for chunk in client.completions.create(
        model=model,
        prompt=PROMPT_IDS,
        n=2,
        max_tokens=8,
        temperature=0,
        stream=True,
        extra_body={"use_beam_search": True, "best_of": 3},
    ):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == [c.text for c in beams.choices]


def post(up, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{up[0]}{path}", json=body, headers={"Authorization": "Bearer sk-test-1"}, timeout=60)


@pytest.mark.parametrize(
    "method, path, status, message",
    [
        ("GET", "/v1/foo", 404, "Invalid URL (GET /v1/foo)"),
        ("POST", "/v2/completions", 404, "Invalid URL (POST /v2/completions)"),
        ("GET", "/v1/completions", 405, "Invalid method for URL (GET /v1/completions): use POST"),
        ("DELETE", "/v1/models", 405, "Invalid method for URL (DELETE /v1/models): use GET"),
    ],
)
def test_unknown_urls_and_methods_in_openai_shape(up, method, path, status, message):
    r = httpx.request(method, f"{up[0].removesuffix('/v1')}{path}", headers={"Authorization": "Bearer sk-test-1"})
    assert r.status_code == status
    assert r.json() == {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}


@pytest.mark.parametrize(
    "path, extra",
    [("/completions", {"prompt": "hi"}), ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})],
)
@pytest.mark.parametrize(
    "model, message",
    [
        (None, "you must provide a model parameter"),
        ("", "you must provide a model parameter"),
        (5, "model must be a string"),
    ],
)
def test_model_is_required(up, path, extra, model, message):
    body = {**extra, "max_tokens": 2} | ({} if model is None else {"model": model})
    r = post(up, path, body)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["message"].startswith(message) and error["param"] == "model"
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "message, param",
    [
        ({"role": "user"}, "messages[0].content"),
        ({"role": "user", "content": None}, "messages[0].content"),
        ({"role": "user", "content": 5}, "messages[0].content"),
        ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, "messages[0].content"),
        ({"content": "hi"}, "messages[0].role"),
        ("hi", "messages[0]"),
    ],
)
def test_chat_content_must_be_text(up, message, param):
    r = post(up, "/chat/completions", {"model": up[2], "max_tokens": 2, "messages": [message]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["message"].startswith(param)


def test_chat_content_may_be_empty_as_in_openai(up, client):
    """OpenAI's API takes "" as a content (it is a string); so does pdserve: the template renders it."""
    for content in ("", [{"type": "text", "text": ""}]):
        result = client.chat.completions.create(
            model=up[2],
            max_tokens=2,
            messages=[{"role": "system", "content": content}, {"role": "user", "content": content}],
        )
        assert result.usage.completion_tokens >= 1 and result.usage.prompt_tokens > 0


def test_api_keys(up):
    bad = openai.OpenAI(base_url=up[0], api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    r = httpx.post(f"{up[0]}/completions", json={"model": up[2], "prompt": "hi"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_the_same_api_keys_guard_the_grpc_api(up):
    """--api-key-file: gRPC clients send one of the keys as `authorization: Bearer <key>` metadata;
    without one, or with another, every Generation method is UNAUTHENTICATED naming the API key,
    while the health service stays open for probes. `pdserve generate --api-key-file` sends it."""
    _, grpc_addr, model, keys = up
    for key in (KEY, OTHER_KEY):
        with Client(grpc_addr, api_key=key) as c:
            assert len(c.generate(PROMPT_IDS, max_tokens=3, ignore_eos=True).token_ids) == 3
            assert c.models() == [model]
    for client in (
        Client(grpc_addr),
        Client(grpc_addr, api_key="sk-wrong"),
        Client(grpc_addr, metadata=[("authorization", KEY)]),
    ):  # not a Bearer value
        with client as c:
            for call in (lambda: c.generate(PROMPT_IDS, max_tokens=3), c.models, lambda: c.tokenize("hi")):
                with pytest.raises(grpc.RpcError) as err:
                    call()
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "invalid or missing API key" in err.value.details()
    with grpc.insecure_channel(grpc_addr) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    argv = [sys.executable, "-m", "pdserve", "generate", "--addr", grpc_addr, "--raw", "--max-tokens", "3", "Hi"]
    assert subprocess.run(argv + ["--api-key-file", str(keys)], capture_output=True, timeout=120).returncode == 0
    refused = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1 and refused.stderr.startswith("pdserve: error: UNAUTHENTICATED: invalid or missing")


def test_each_api_key_and_cache_salt_has_its_own_prefix_cache(up):
    """Under API keys a key's requests share cached blocks (over HTTP and gRPC alike), another
    key's never do: one tenant cannot time another's prompts. cache_salt splits a key further."""
    http, grpc_addr, model, _ = up
    prompt = [(43 * i) % 300 + 10 for i in range(41)]  # seen by no other test

    def cached(key: str, **extra) -> int:
        c = openai.OpenAI(base_url=http, api_key=key, max_retries=0)
        reply = c.completions.create(model=model, prompt=prompt, max_tokens=2, extra_body=extra)
        return reply.usage.prompt_tokens_details.cached_tokens

    assert cached(KEY) == 0 and cached(KEY) == 40
    with Client(grpc_addr, api_key=KEY) as c:  # the same key over gRPC: the same tenant
        assert c.generate(prompt, max_tokens=2).timings["cached_tokens"] == 40
    assert cached(OTHER_KEY) == 0 and cached(OTHER_KEY) == 40
    assert cached(KEY, cache_salt="team-1") == 0 and cached(KEY, cache_salt="team-1") == 40
    assert cached(OTHER_KEY, cache_salt="team-1") == 0
    bad = openai.OpenAI(base_url=http, api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="cache_salt must be a non-empty string"):
        bad.completions.create(model=model, prompt=prompt, max_tokens=2, extra_body={"cache_salt": 7})


@contextlib.asynccontextmanager
async def http_over_local_cluster(model):
    """An in-process cluster (nodes whose health a test can change) with the HTTP API on it."""
    from cluster import local_cluster

    from router.openai_api import OpenAIAPI, build_app, serve_http

    async with local_cluster(model) as (router, prefills, decodes):
        server, task, port = await serve_http(build_app(OpenAIAPI(router)), "127.0.0.1", 0)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
                yield router, prefills, decodes, http
        finally:
            server.should_exit = True
            await task


async def until(condition, timeout_s: float = 10.0) -> None:
    """Health checks run every 0.2 s in local_cluster: wait for the router to notice."""
    for _ in range(int(timeout_s / 0.05)):
        if condition():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the router did not notice in time")


def test_cached_prompt_tokens_are_in_usage(tiny_llama):
    """usage.prompt_tokens_details.cached_tokens: the prompt tokens the prefix cache of the node
    that ran the prefill held: 0 for a prompt never seen, all but the last block's when it comes
    again (blocks of 4 tokens; the last prompt token is always computed), in the streamed usage
    chunk too. On a cluster of its own: where a prefill runs must not be the router's measured
    choice (`pdserve up`'s local_prefill auto), or a repeat may go to the node that lacks it."""

    async def scenario():
        async with http_over_local_cluster(tiny_llama) as (router, prefills, decodes, http):
            base_url = f"{str(http.base_url).rstrip('/')}/v1"
            async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
                await cached_tokens_scenario(router, client, str(tiny_llama))

    asyncio.run(scenario())


async def cached_tokens_scenario(router, client: openai.AsyncOpenAI, model: str) -> None:
    for mode, seed in (("off", 37), ("always", 41)):  # prefilled on the prefill node; on the decode node
        router.placement.mode = mode
        prompt = [(seed * i) % 300 + 10 for i in range(41)]  # seen by no other request
        first, again = [await client.completions.create(model=model, prompt=prompt, max_tokens=2) for _ in range(2)]
        assert first.usage.prompt_tokens_details.cached_tokens == 0, mode
        assert again.usage.prompt_tokens_details.cached_tokens == 40, mode
    router.placement.mode = "off"
    messages = [{"role": "user", "content": "a conversation no other request has " * 4}]
    usages = []
    for _ in range(2):
        stream = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=2, stream=True, stream_options={"include_usage": True}
        )
        chunks = [c async for c in stream]
        assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
        usages.append(chunks[-1].usage)
    first, again = (u.prompt_tokens_details.cached_tokens for u in usages)
    assert first == 0 and again == (usages[1].prompt_tokens - 1) // 4 * 4


def test_overload_is_429_and_no_node_is_503(tiny_llama):
    async def scenario():
        async with http_over_local_cluster(tiny_llama) as (router, prefills, decodes, http):
            body = {"model": str(tiny_llama), "prompt": "hi", "max_tokens": 2}
            router.max_outstanding = 0
            r = await http.post("/v1/completions", json=body)
            assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
            router.max_outstanding = 100
            await decodes[0].server.set_serving(False)  # the only decode node drains
            await until(lambda: not router.decode_pool.endpoints[0].healthy)
            r = await http.post("/v1/completions", json=body)
            error = r.json()["error"]
            assert r.status_code == 503 and "no healthy decode node" in error["message"]
            assert error["param"] is None  # no request field is at fault (it was "no")

    asyncio.run(scenario())


def test_health_is_503_and_not_serving_without_a_healthy_node_in_a_pool_it_needs(tiny_llama):
    async def grpc_health(address: str, service: str = "") -> str:
        async with grpc.aio.insecure_channel(address) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service))
            return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    async def scenario():
        async with http_over_local_cluster(tiny_llama) as (router, prefills, decodes, http):
            r = await http.get("/health")
            assert r.status_code == 200
            assert r.json() == {
                "status": "ok",
                "prefill": {"healthy": 1, "nodes": 1},
                "decode": {"healthy": 1, "nodes": 1},
            }
            assert await grpc_health(router.address) == "SERVING"
            await decodes[0].server.set_serving(False)
            await until(lambda: not router.decode_pool.healthy())
            r = await http.get("/health")
            assert r.status_code == 503 and r.json()["status"] == "unavailable"
            assert r.json()["message"].startswith("no healthy decode node (of 1: ")
            assert r.json()["decode"] == {"healthy": 0, "nodes": 1}
            for service in ("", "pdserve.v1.Generation"):
                assert await grpc_health(router.address, service) == "NOT_SERVING"
            assert await grpc_health(router.address, "liveness") == "SERVING"  # the process itself runs
            await prefills[0].server.stop(0)  # the prefill node's port goes away too
            await until(lambda: not router.prefill_pool.healthy())
            router.placement.mode = "off"  # every prefill remote: the prefill pool is needed
            r = await http.get("/health")
            assert "no healthy prefill node" in r.json()["message"]
            assert "no healthy decode node" in r.json()["message"]
            await decodes[0].server.set_serving(True)  # decode comes back; prefill is still gone
            await until(lambda: router.decode_pool.healthy())
            assert (await http.get("/health")).status_code == 503
            assert await grpc_health(router.address) == "NOT_SERVING"
            router.placement.mode = "auto"  # the decode node prefills when no prefill node can
            r = await http.get("/health")
            assert r.status_code == 200 and r.json()["prefill"] == {"healthy": 0, "nodes": 1}
            await router._follow_pools()  # (what a pool's change would call)
            assert await grpc_health(router.address) == "SERVING"
            body = {"model": router.model_id, "prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": True}
            r = await http.post("/v1/completions", json=body)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3

    asyncio.run(scenario())

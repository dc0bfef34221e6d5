"""Tool calling: the parsers of each format (whole and streamed at any split), the request's
tools checked and rendered, and OpenAI's tools / tool_choice through `pdserve up` with the
official client (remote and local prefill, n-gram speculation on), a call migrated mid-stream."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve_api import generate_pb2
from serving.tool_calls import (
    PARSERS,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    NamedParser,
    RequiredParser,
    ToolCalls,
    constrained_output,
    parser_for_template,
    tool_calls_for,
)

HERMES_TEMPLATE = Path(__file__).parent.parent / "deploy" / "chat_templates" / "hermes_tools.jinja"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "A city's forecast", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


# ---- parsers -----------------------------------------------------------------------------------
CASES = [  # (parser, output text, content, [(name, arguments)])
    (
        HermesParser,
        'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>',
        "Checking.\n",
        [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"zone": "UTC"})],
    ),
    (HermesParser, 'a <tool_call>{"name": oops}</tool_call> b', 'a <tool_call>{"name": oops}</tool_call> b', []),
    (HermesParser, '<tool_call>\n{"name": "get_time", "arguments": {}}\n', "", [("get_time", {})]),  # stopped early
    (HermesParser, "x < y and <tool_ca", "x < y and <tool_ca", []),
    (
        Llama3JsonParser,
        '{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}',
        "",
        [("f", {"x": 1}), ("g", {})],
    ),
    (Llama3JsonParser, '<|python_tag|>{"name": "f", "parameters": {"q": "a;b"}}', "", [("f", {"q": "a;b"})]),
    (Llama3JsonParser, "  Hello {not a call}", "  Hello {not a call}", []),
    (Llama3JsonParser, '{"answer": 1}', '{"answer": 1}', []),
    (MistralParser, 'Sure. [TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}]', "Sure. ", [("f", {"a": 1})]),
    (
        MistralParser,
        '[{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"b": [1]}}]',
        "",
        [("f", {}), ("g", {"b": [1]})],
    ),
    (MistralParser, "[1, 2] is a list", "[1, 2] is a list", []),
    (MistralParser, '[\n  {"name": "f", "arguments": {}}]', "", [("f", {})]),
    (RequiredParser, '[{"name":"get_time","parameters":{"zone":"CET"}}]', "", [("get_time", {"zone": "CET"})]),
]


def parse(parser, pieces: list[str], finish: str = "stop"):
    """(content, [(name, arguments)], finish_reason) as ToolCalls rewrites a stream of messages;
    checks each call's first fragment has its id and name and the later ones have neither."""
    tools = ToolCalls(parser)
    content, calls, reason = "", [], ""
    for i, text in enumerate(pieces):
        msg = generate_pb2.GenerateResponse(text=text, finish_reason=finish if i == len(pieces) - 1 else "")
        tools.rewrite(msg)
        content += msg.text
        reason = msg.finish_reason or reason
        for part in msg.tool_calls:
            if part.index == len(calls):
                assert part.id.startswith("call_") and part.name, part
                calls.append([part.name, ""])
            else:
                assert not part.id and not part.name, part
            calls[part.index][1] += part.arguments
    return content, [(name, json.loads(args)) for name, args in calls], reason


@pytest.mark.parametrize("parser, text, content, calls", CASES)
def test_each_format_parses_into_content_and_calls(parser, text, content, calls):
    got_content, got_calls, reason = parse(parser, [text])
    assert (got_content, got_calls) == (content, calls)
    assert reason == ("tool_calls" if calls else "stop")


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(0, 200), max_size=12))
def test_a_stream_split_anywhere_parses_as_the_whole(case, cuts):
    parser, text, content, calls = case
    cuts = sorted({c % (len(text) + 1) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    assert parse(parser, pieces)[:2] == (content, calls)


def test_a_named_call_streams_its_arguments_as_they_come():
    tools = ToolCalls(lambda: NamedParser("get_time"))
    msgs = [generate_pb2.GenerateResponse(text=t) for t in ('{"zo', 'ne":"U', 'TC"}')]
    msgs[-1].finish_reason = "stop"
    for m in msgs:
        tools.rewrite(m)
    assert [m.text for m in msgs] == ["", "", ""] and msgs[-1].finish_reason == "tool_calls"
    assert [(c.name, c.arguments) for m in msgs for c in m.tool_calls] == [
        ("get_time", '{"zo'),
        ("", 'ne":"U'),
        ("", 'TC"}'),
    ]


def test_a_call_cut_by_max_tokens_stays_text_and_says_length():
    cut = '[{"name":"get_time","param'
    assert parse(RequiredParser, [cut], "length") == (cut, [], "length")
    assert parse(HermesParser, ['hi <tool_call>{"name": "f", "argu'], "length") == (
        'hi <tool_call>{"name": "f", "argu',
        [],
        "length",
    )


def test_the_parser_is_found_from_the_chat_template():
    assert parser_for_template(HERMES_TEMPLATE.read_text()) == "hermes"
    assert parser_for_template("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert parser_for_template("{{ '<|python_tag|>' }}") == "llama3_json"
    assert parser_for_template("{{ messages[0].content }}") is None
    assert set(PARSERS) == {"hermes", "llama3_json", "mistral"}


# ---- the request's tools -------------------------------------------------------------------------
def chat(tools=TOOLS, mode: str | None = None, function: str | None = None) -> generate_pb2.ChatMessages:
    m = generate_pb2.ChatMessages(messages=[generate_pb2.ChatMessage(role="user", content="hi")])
    for t in tools:
        f = t["function"]
        m.tools.add(
            name=f["name"], description=f.get("description", ""), parameters=json.dumps(f.get("parameters", {}))
        )
    if mode is not None:
        m.tool_choice_mode = mode
    if function is not None:
        m.tool_choice_function = function
    return m


@pytest.mark.parametrize(
    "request_, words",
    [
        (chat(function="nope"), "tool_choice: no tool named 'nope'"),
        (chat(tools=[], mode="required"), "tool_choice: required needs tools, and the request has none"),
        (chat(mode="sometimes"), "tool_choice must be one of ('none', 'auto', 'required')"),
        (chat(tools=[TOOLS[0], TOOLS[0]]), "tools[1].function.name: 'get_weather' is named twice"),
        (chat(tools=[{"function": {"name": "a b"}}]), "tools[0].function.name must match"),
        (chat(mode="auto"), "tool_choice: auto needs a tool-call format"),
    ],
)
def test_bad_tools_are_refused_naming_the_field(request_, words):
    with pytest.raises(ValueError, match="^" + re.escape(words)):
        tool_calls_for(request_, "auto", "{{ messages }}")


def test_required_hoists_each_schemas_definitions():
    """Pydantic writes tool schemas with $defs: under required they move to the list's top, where
    their references point, and the grammar compiles."""
    from engine.structured_output import StructuredOutput

    unit = {"enum": ["C", "F"]}
    with_defs = {"type": "object", "properties": {"unit": {"$ref": "#/$defs/Unit"}}, "$defs": {"Unit": unit}}
    tools = [{"function": {"name": "temp", "parameters": with_defs}}, TOOLS[1]]
    so = constrained_output(chat(tools, mode="required"))
    schema = json.loads(so.spec)
    assert schema["$defs"] == {"Unit": unit} and "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    StructuredOutput(so.kind, so.spec).grammar()  # compiles: the reference resolves
    clash = {**with_defs, "$defs": {"Unit": {"enum": ["K"]}}}
    with pytest.raises(ValueError, match=re.escape("tools: two functions define $defs/Unit differently")):
        constrained_output(chat([tools[0], {"function": {"name": "other", "parameters": clash}}], mode="required"))


def test_mistral_templates_get_ids_they_take_back():
    tools = tool_calls_for(chat(function="get_time"), "auto", "{{ '[TOOL_CALLS]' }}")
    msg = generate_pb2.GenerateResponse(text='{"zone":"UTC"}', finish_reason="stop")
    tools.rewrite(msg)
    assert re.fullmatch("[a-zA-Z0-9]{9}", msg.tool_calls[0].id), msg


def test_a_template_that_raises_is_a_bad_request_naming_messages(tiny_llama):
    from engine.tokenizer import apply_chat_template, load_tokenizer

    tokenizer = load_tokenizer(tiny_llama)
    tokenizer.chat_template = "{{ raise_exception('only one tool call at a time') }}"
    with pytest.raises(ValueError, match="^messages: the chat template refused them: only one tool call at a time"):
        apply_chat_template(tokenizer, [{"role": "user", "content": "hi"}])


def test_a_models_tool_use_template_names_the_parser(tiny_llama):
    """A tokenizer with named templates (default, tool_use): the tool_use one names the format."""
    from router.frontend import Frontend

    frontend = Frontend(str(tiny_llama))
    frontend.tokenizer.chat_template = {"default": "{{ messages }}", "tool_use": HERMES_TEMPLATE.read_text()}
    assert parser_for_template(frontend._template()) == "hermes"


def test_merged_stream_messages_keep_every_call_fragment():
    """Ray Serve's gRPC ingress merges messages that queue behind a slow client."""
    from router.deployment import _merge

    a = generate_pb2.GenerateResponse(
        text="x", tool_calls=[generate_pb2.ToolCall(index=0, id="c1", name="f", arguments='{"a"')]
    )
    b = generate_pb2.GenerateResponse(
        tool_calls=[
            generate_pb2.ToolCall(index=0, arguments=":1}"),
            generate_pb2.ToolCall(index=1, id="c2", name="g", arguments="{}"),
        ]
    )
    merged = _merge(a, b)
    assert [(c.index, c.id, c.name, c.arguments) for c in merged.tool_calls] == [
        (0, "c1", "f", '{"a":1}'),
        (1, "c2", "g", "{}"),
    ]


def test_tool_choice_none_and_no_tools_leave_the_output_alone():
    assert tool_calls_for(chat(mode="none"), "auto", "") is None
    assert tool_calls_for(chat(tools=[]), "auto", "") is None
    assert constrained_output(chat()) is None  # auto: parsed, not held


# ---- through pdserve up, with the official client -------------------------------------------------
@pytest.fixture(scope="module")
def tiny_long(tmp_path_factory) -> Path:
    """A tiny Llama with room for a tool-laden prompt in its byte-sized tokens."""
    from tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-long"), "llama", seed=2, max_position_embeddings=4096)


@pytest.fixture(scope="module", params=["off", "always"])
def up(request, tiny_long, tmp_path_factory):
    """pdserve up on the tiny model with the Hermes tools template, prefill remote (off) or on the
    decode node (always), n-gram speculation on the decode steps."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdserve",
            "up",
            *("--model", str(tiny_long), "--port", "0", "--http-port", "0", "--dtype", "float32"),
            *("--kv-cache-gb", "0.01", "--block-size", "4", "--num-threads", "1"),
            *("--chat-template", str(HERMES_TEMPLATE), "--local-prefill", request.param),
            *("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'),
            *("--log-dir", str(tmp_path_factory.mktemp("logs"))),
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    http = None
    for line in proc.stderr:
        if "OpenAI-compatible HTTP API on" in line:
            http = line.split("on ")[-1].strip()
        if line.startswith("pdserve up: router on "):
            break
    threading.Thread(target=proc.stderr.read, daemon=True).start()
    assert http, "pdserve up did not come up"
    yield openai.OpenAI(base_url=http, api_key="none", max_retries=0), str(tiny_long)
    proc.terminate()
    proc.wait(timeout=60)


def ask(up, stream: bool, **kwargs):
    """(content, [(name, arguments text)], finish_reason) of one chat request, streamed or not."""
    client, model = up
    kwargs = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 80, **kwargs}
    reply = client.chat.completions.create(model=model, tools=TOOLS, stream=stream, **kwargs)
    if not stream:
        message = reply.choices[0].message
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
        assert all(c.id.startswith("call_") and c.type == "function" for c in message.tool_calls or [])
        return message.content, calls, reply.choices[0].finish_reason
    content, calls, finish = "", [], None
    for chunk in reply:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or []:
            if part.index == len(calls):
                assert part.id and part.function.name, part
                calls.append([part.function.name, ""])
            calls[part.index][1] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content or None, [tuple(c) for c in calls], finish


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_a_named_call_validates_and_streams_as_it_answers(up, temperature):
    import jsonschema

    choice = {"type": "function", "function": {"name": "get_weather"}}
    whole = ask(up, False, tool_choice=choice, temperature=temperature, seed=3)
    streamed = ask(up, True, tool_choice=choice, temperature=temperature, seed=3)
    assert whole == streamed  # fp32, same seed: the same tokens either way
    content, calls, finish = whole
    assert content is None and finish == "tool_calls" and [name for name, _ in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0][1]), WEATHER)


def test_a_named_call_is_the_engines_own_tokens(up):
    """fp32, greedy, speculation on and the P/D split: a named call's arguments are what one
    engine alone writes for the rendered prompt under the function's schema."""
    from conftest import engine_alone

    from engine.structured_output import StructuredOutput
    from engine.tokenizer import apply_chat_template, load_tokenizer

    client, model = up
    tokenizer = load_tokenizer(Path(model))
    tokenizer.chat_template = HERMES_TEMPLATE.read_text()
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    prompt = tokenizer.encode(apply_chat_template(tokenizer, messages, tools=TOOLS), add_special_tokens=False)
    so = StructuredOutput("json_schema", json.dumps(WEATHER))
    (want,) = engine_alone(Path(model), [prompt], structured_output=so, temperature=0, max_tokens=80)
    reply = client.chat.completions.create(
        model=model,
        messages=messages,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
        max_tokens=80,
    )
    assert reply.usage.prompt_tokens == len(prompt) and reply.usage.completion_tokens == len(want)
    assert reply.choices[0].message.tool_calls[0].function.arguments == tokenizer.decode(want, skip_special_tokens=True)


@pytest.mark.parametrize("parallel", [False, True])
def test_a_required_call_is_one_or_more_valid_calls(up, parallel):
    """Sampled: parallel_tool_calls false gives exactly one valid call; true a list of valid calls,
    or (a random model may go on listing calls) an end by max_tokens as text, never a call that
    does not parse."""
    import jsonschema

    for seed in range(3):
        kwargs = dict(tool_choice="required", parallel_tool_calls=parallel, temperature=1.0, seed=seed, max_tokens=200)
        whole = ask(up, False, **kwargs)
        assert whole == ask(up, True, **kwargs)
        content, calls, finish = whole
        if finish == "length" and parallel:
            assert content.startswith('[{"name":') and not calls
            continue
        assert content is None and finish == "tool_calls" and (len(calls) == 1 or parallel and calls)
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_auto_answers_what_the_hermes_parser_reads_in_the_plain_output(up):
    """tool_choice none renders the same prompt and leaves the text alone: auto must answer what
    the Hermes parser makes of that text (the tiny random model rarely calls anything, so this
    holds the auto path to the plain one; the parser itself is tested above)."""
    plain, _, plain_finish = ask(up, False, tool_choice="none", temperature=0)
    content, calls, finish = ask(up, False, tool_choice="auto", temperature=0)
    want_content, want_calls, want_finish = parse(HermesParser, [plain], plain_finish)
    assert (content or "", calls, finish) == (
        want_content,
        [(n, json.dumps(a, ensure_ascii=False)) for n, a in want_calls],
        want_finish,
    )
    assert ask(up, True, tool_choice="auto", temperature=0) == (content, calls, finish)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("temperature", [0, 1.0])
def test_response_format_validates_across_the_split_with_speculation(up, stream, temperature):
    """A JSON schema response (no tools) on the same cluster: prefill remote or on the decode
    node, n-gram drafts checked against the grammar; ended by the model, it validates."""
    import jsonschema

    client, model = up
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER, "strict": True}}
    messages = [{"role": "user", "content": "Paris?"}]
    reply = client.chat.completions.create(
        model=model, messages=messages, response_format=fmt, temperature=temperature, seed=5, stream=stream
    )
    if stream:
        chunks = [c.choices[0] for c in reply if c.choices]
        text, finish = "".join(c.delta.content or "" for c in chunks), [c.finish_reason for c in chunks][-1]
    else:
        text, finish = reply.choices[0].message.content, reply.choices[0].finish_reason
    assert finish == "stop"
    jsonschema.validate(json.loads(text), WEATHER)


def test_a_tool_call_round_trip(up):
    """The call goes back as the assistant's message with the tool's answer after it: accepted,
    and rendered by the template (the prompt grows by the call and the answer)."""
    client, model = up
    choice = {"type": "function", "function": {"name": "get_weather"}}
    first = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS, tool_choice=choice
    )
    call = first.choices[0].message.tool_calls[0]
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "22 C and sunny"},
    ]
    second = client.chat.completions.create(model=model, messages=history, tools=TOOLS, max_tokens=5)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + len(call.function.arguments) // 4


@pytest.mark.parametrize(
    "kwargs, param, words",
    [
        (dict(tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice", "no tool named 'nope'"),
        (
            dict(
                tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}],
                tool_choice="required",
            ),
            "tools",
            "tools: a function's parameters schema cannot be held to",
        ),
        (dict(tool_choice="auto", response_format={"type": "json_object"}), "tool_choice", "cannot be combined"),
        (dict(tools=[{"type": "function", "function": {"name": "f"}}, "x"]), "tools", "tools[1] must be"),
        (dict(tools=None, tool_choice="auto"), "tool_choice", "tool_choice: auto needs tools"),
        (dict(tools=None, tool_choice="function"), "tool_choice", "tool_choice must be one of"),
        (dict(tool_choice="required", extra_body={"ignore_eos": True}), "tool_choice", "takes no ignore_eos"),
        (
            dict(messages=[{"role": "assistant", "tool_calls": [{"id": 7, "function": {"name": "f"}}]}]),
            "messages[0].tool_calls[0]",
            'messages[0].tool_calls[0] must be {"id", "type": "function"',
        ),
        (
            dict(messages=[{"role": "tool", "content": "22 C"}]),
            "messages[0].tool_call_id",
            "messages[0].tool_call_id: a tool message names the call it answers",
        ),
    ],
)
def test_bad_tool_requests_are_400_naming_the_field(up, kwargs, param, words):
    client, model = up
    kwargs = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, **kwargs}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, max_tokens=4, **kwargs)
    body = err.value.response.json()["error"]
    assert words in body["message"] and body["param"] == param, body


def test_tools_are_refused_by_the_completions_endpoint(up):
    client, model = up
    with pytest.raises(openai.BadRequestError, match="only /v1/chat/completions calls tools"):
        client.completions.create(model=model, prompt="hi", max_tokens=2, extra_body={"tools": TOOLS})


def test_a_call_migrated_mid_stream_still_validates(tiny_long):
    """The decode node streaming a named call stops after its first fragments: the request
    migrates to the other decode node and the call's arguments, joined, still validate and
    equal an undisturbed run's (fp32, greedy)."""
    import jsonschema
    from cluster import local_cluster

    from router.openai_api import OpenAIAPI, build_app, serve_http

    body = {
        "model": str(tiny_long),
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": 80,
        "temperature": 0,
        "stream": True,
    }

    async def arguments(http, decodes, stop: bool) -> tuple[str, str, int]:
        args, finish, stopped = "", None, None
        async with http.stream("POST", "/v1/chat/completions", json=body) as reply:
            async for line in reply.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                choice = json.loads(line[6:])["choices"][0]
                for part in choice["delta"].get("tool_calls") or []:
                    args += part["function"]["arguments"]
                finish = choice["finish_reason"] or finish
                if stop and stopped is None and len(args) >= 3:
                    stopped = next(d for d in decodes if d.num_active)
                    await stopped.stop(0)
        return args, finish, stopped is not None

    async def scenario():
        cluster = local_cluster(tiny_long, num_decode=2, chat_template=str(HERMES_TEMPLATE))
        async with cluster as (router, _, decodes):
            server, task, port = await serve_http(build_app(OpenAIAPI(router)), "127.0.0.1", 0)
            try:
                async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=None) as http:
                    return await arguments(http, decodes, False), await arguments(http, decodes, True)
            finally:
                server.should_exit = True
                await task

    undisturbed, migrated = asyncio.run(scenario())
    assert migrated[2], "no decode node was stopped"
    assert migrated[:2] == undisturbed[:2] and undisturbed[1] == "tool_calls"
    jsonschema.validate(json.loads(migrated[0]), WEATHER)

"""An OpenAI-compatible HTTP API over the same request path as the gRPC one.

POST /v1/completions, POST /v1/chat/completions (both with `stream: true` as server-sent events
ending in `data: [DONE]`; `stream_options.include_usage` adds a usage chunk, vLLM's
`stream_options.continuous_usage_stats` a running usage on every chunk), GET /v1/models, GET /health.
`usage.prompt_tokens_details.cached_tokens` counts the prompt tokens the prefilling node's prefix
cache held. Each request becomes a pdserve GenerateRequest and goes through `Frontend.serve` (the
router's disaggregated path, or the colocated baseline's): same checks, same metrics, same tokens.
`max_tokens` defaults as in OpenAI's API: the rest of the context for chat, 16 for completions.

Errors have OpenAI's shape, {"error": {"message", "type", "param", "code"}}, unknown URLs and
wrong methods included; `param` names the request field at fault, or is null when none is (an
overloaded or unavailable cluster).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import AsyncIterator

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from kvtransfer.security import authorized
from pdserve_api import common_pb2, generate_pb2
from router.frontend import Frontend, RequestError

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
ERROR_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    504: "timeout",
}
# OpenAI parameters with no pdserve meaning: accepted at their neutral value, refused otherwise.
NEUTRAL = {
    "echo": False,
    "suffix": None,
}
# The request fields an error's `param` may name: pdserve's error messages start with the field at
# fault ("max_tokens must be ...", "messages[2].content ..."), or with anything else when none is.
PARAMS = {
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "logprobs",
    "top_logprobs",
    "n",
    "best_of",
    "stream",
    "stream_options",
    "ignore_eos",
    "use_beam_search",
    "length_penalty",
    "beam_width",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "min_p",
    "min_tokens",
    "bad_words",
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_output",  # the frontend's name of whichever of these a request used (see _api_error)
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    *NEUTRAL,
}
# vLLM's structured_outputs keys (and its older guided_* fields) -> StructuredOutput kinds
STRUCTURED_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}
STRUCTURED_FIELDS = ("response_format", "structured_outputs", *(f"guided_{k}" for k in STRUCTURED_KEYS))


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": ERROR_TYPE.get(self.status, "server_error"),
                "param": self.param,
                "code": self.code,
            }
        }


class OpenAIAPI:
    def __init__(self, frontend: Frontend, api_keys: tuple[str, ...] = ()):
        self.frontend = frontend
        self.api_keys = tuple(f"Bearer {k}".encode() for k in api_keys)

    # ---- endpoints --------------------------------------------------------------------------
    async def completions(self, request: Request):
        return await self._handle(request, chat=False)

    async def chat_completions(self, request: Request):
        return await self._handle(request, chat=True)

    async def models(self, request: Request):
        try:
            self._authorize(request)
        except APIError as e:
            return JSONResponse(e.body(), status_code=e.status)
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.frontend.model_id,
                        "object": "model",
                        "created": 0,
                        "owned_by": "pdserve",
                        "max_model_len": self.frontend.max_model_len,
                    }
                ],
            }
        )

    async def health(self, request: Request):
        """200 when a request can be served now, else 503 naming the pool without a healthy node."""
        report = self.frontend.health()
        return JSONResponse(report, status_code=200 if report["status"] == "ok" else 503)

    # ---- one request ------------------------------------------------------------------------
    async def _handle(self, request: Request, chat: bool):
        body = {}
        try:
            self._authorize(request)
            body = await _json(request)
            req, stream, logprobs = self._to_pdserve(body, chat)
            include_usage, continuous = _stream_options(body, stream)
            # continuous usage names the prompt's tokens on every chunk, before the final message does
            prompt_tokens = self._prompt_length(req) if continuous else None
            client = request.headers.get("x-client-id") or (request.client.host if request.client else "")
            key = request.headers.get("authorization", "")
            if not stream:
                whole = await self.frontend.generate_unary(req, _deadline(request), client, key)
                return JSONResponse(self._response(whole, chat, logprobs, body))
            parts = self.frontend.serve(req, _deadline(request), client, key)
            first = await anext(parts, None)  # errors before the first token get a proper status
            return StreamingResponse(
                self._sse(first, parts, chat, include_usage, prompt_tokens, logprobs, body),
                media_type="text/event-stream",
            )
        except APIError as e:
            return JSONResponse(e.body(), status_code=e.status)
        except RequestError as e:
            error = _api_error(e, body)
            return JSONResponse(error.body(), status_code=error.status)

    def _authorize(self, request: Request) -> None:
        if not self.api_keys:
            return
        if not authorized(request.headers.get("authorization", ""), self.api_keys):
            raise APIError(401, "invalid or missing API key (Authorization: Bearer <key>)", code="invalid_api_key")

    def _to_pdserve(self, body: dict, chat: bool):
        for name, neutral in NEUTRAL.items():
            if body.get(name, neutral) not in (neutral, None):
                raise APIError(400, f"{name} is not supported (only {neutral!r})", name)
        n, best_of = body.get("n", 1), body.get("best_of")
        beam_width = None
        if body.get("use_beam_search"):  # vLLM's extension: best_of (else n) beams, the n best returned
            beam_width, best_of = best_of or n, None
        if best_of is not None and best_of != n and body.get("stream"):
            raise APIError(
                400, "best_of must equal n when streaming (the best samples are known only at the end)", "best_of"
            )
        req = generate_pb2.GenerateRequest(model=_model(body))
        if chat:
            req.messages.CopyFrom(generate_pb2.ChatMessages(messages=_messages(body.get("messages"))))
            _tools(req.messages, body)
            logprobs = body.get("top_logprobs", 0) if body.get("logprobs") else None
            max_tokens = body.get("max_completion_tokens")
            max_tokens = body.get("max_tokens") if max_tokens is None else max_tokens
        else:
            for name in ("tools", "tool_choice", "parallel_tool_calls"):
                if body.get(name) is not None:
                    raise APIError(400, f"{name}: only /v1/chat/completions calls tools", name)
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]  # a batch of one
            if isinstance(prompt, str):
                req.prompt = prompt
            elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                req.prompt_token_ids.CopyFrom(common_pb2.TokenIds(ids=prompt))
            else:
                raise APIError(400, "prompt must be a string or a list of token ids (one prompt per request)", "prompt")
            logprobs = body.get("logprobs")
            # OpenAI's documented default for the legacy completions endpoint is 16 tokens (vLLM
            # uses the rest of the context here too); clients written against OpenAI expect 16
            max_tokens = body.get("max_tokens")
            max_tokens = 16 if max_tokens is None else max_tokens
        sampling = req.sampling
        for name, value, kind in (
            ("max_tokens", max_tokens, int),
            ("temperature", body.get("temperature"), float),
            ("top_p", body.get("top_p"), float),
            ("seed", body.get("seed"), int),
            ("logprobs", logprobs, int),
            ("n", n, int),
            ("best_of", best_of, int),
            ("beam_width", beam_width, int),
            ("length_penalty", body.get("length_penalty"), float),
            ("presence_penalty", body.get("presence_penalty"), float),
            ("frequency_penalty", body.get("frequency_penalty"), float),
            ("repetition_penalty", body.get("repetition_penalty"), float),
            ("min_p", body.get("min_p"), float),
            ("min_tokens", body.get("min_tokens"), int),
        ):
            if value is not None:
                setattr(sampling, name, _typed(name, value, kind))
        _penalties(sampling, body)
        _structured_output(sampling, body)
        sampling.top_k = _typed("top_k", body.get("top_k", 0) or 0, int)
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise APIError(400, "stop must be a string or a list of strings", "stop")
        sampling.stop.extend(stop)
        sampling.ignore_eos = bool(body.get("ignore_eos", False))
        salt = body.get("cache_salt")  # vLLM's extension: prefix caching only among requests with this salt
        if salt is not None:
            if not isinstance(salt, str) or not salt:
                raise APIError(400, "cache_salt must be a non-empty string", "cache_salt")
            sampling.cache_salt = salt
        if not sampling.HasField("max_tokens"):  # chat without max_tokens
            sampling.max_tokens = self._rest_of_context(req)
        return req, bool(body.get("stream", False)), logprobs

    def _rest_of_context(self, req: generate_pb2.GenerateRequest) -> int:
        """OpenAI's (and vLLM's) chat default for max_tokens: what the router's max_model_len leaves
        after the prompt. At least 1, so that a prompt filling the context is refused by the
        frontend's own check, naming the prompt, rather than as a bad max_tokens."""
        return max(1, self.frontend.max_model_len - self._prompt_length(req))

    def _prompt_length(self, req: generate_pb2.GenerateRequest) -> int:
        """The prompt's tokens as the frontend will count them (the chat template applied)."""
        kind = req.WhichOneof("input")
        if kind == "prompt_token_ids":
            return len(req.prompt_token_ids.ids)
        tokenize = generate_pb2.TokenizeRequest(**{kind: getattr(req, kind)})
        return len(self.frontend.tokenize(tokenize).token_ids)  # raises RequestError naming the prompt

    # ---- OpenAI shapes ----------------------------------------------------------------------
    def _response(self, whole: generate_pb2.GenerateResponse, chat: bool, logprobs, body: dict) -> dict:
        choices = []
        n = int(body.get("n") or 1)
        for sample in (whole.samples or [whole])[:n]:  # n > 1: one choice per sample (beams: the n best)
            choice: dict = {
                "index": sample.index,
                "finish_reason": sample.finish_reason or "stop",
                "logprobs": self._logprobs(sample, chat) if logprobs is not None else None,
            }
            if chat:
                choice["message"] = _message(sample.text, sample.tool_calls)
            else:
                choice["text"] = sample.text
            choices.append(choice)
        return {
            "id": _id(chat),
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": body.get("model") or self.frontend.model_id,
            "choices": choices,
            "usage": _usage(whole.usage, whole.timings),
        }

    async def _sse(
        self, first, parts, chat: bool, include_usage: bool, prompt_tokens: int | None, logprobs, body: dict
    ) -> AsyncIterator[str]:
        """include_usage: a usage chunk at the end, `usage: null` on the others (OpenAI's shape);
        prompt_tokens: set for continuous usage stats, every chunk then carries the usage so far."""
        rid, created = _id(chat), int(time.time())
        model = body.get("model") or self.frontend.model_id
        kind = "chat.completion.chunk" if chat else "text_completion"
        continuous = prompt_tokens is not None
        completion_tokens = 0  # of every choice, so far

        def event(choices: list, usage=None) -> str:
            chunk = {"id": rid, "object": kind, "created": created, "model": model, "choices": choices}
            if continuous and usage is None:
                usage = _running_usage(prompt_tokens, completion_tokens)
            if include_usage:
                chunk["usage"] = usage
            return f"data: {json.dumps(chunk)}\n\n"

        usage, n = None, int(body.get("n") or 1)
        if chat:  # each choice's first chunk says who speaks
            yield event(
                [{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None} for i in range(n)]
            )
        try:
            msg = first
            while msg is not None:
                completion_tokens += len(msg.token_ids)
                if msg.finished:
                    usage = _usage(msg.usage, msg.timings)
                lp = self._logprobs(msg, chat) if logprobs is not None else None
                reason = msg.finish_reason or None  # set on the message that ends its choice
                if msg.index >= n:  # beam search: hypotheses past the n best are not choices
                    pass
                elif chat:
                    delta = {"content": msg.text} if msg.text else {}
                    if msg.tool_calls:
                        delta["tool_calls"] = [_tool_call(c) for c in msg.tool_calls]
                    yield event(
                        [{"index": msg.index, "delta": delta, "logprobs": lp, "finish_reason": reason}],
                        usage if continuous else None,
                    )
                else:
                    yield event(
                        [{"index": msg.index, "text": msg.text, "logprobs": lp, "finish_reason": reason}],
                        usage if continuous else None,
                    )
                msg = await anext(parts, None)
        except RequestError as e:
            yield f"data: {json.dumps(_api_error(e, body).body())}\n\n"
        if include_usage and usage is not None:
            yield event([], usage)
        yield "data: [DONE]\n\n"

    def _logprobs(self, msg: generate_pb2.GenerateResponse, chat: bool) -> dict:
        tok = self.frontend.tokenizer

        def text(t: int) -> str:
            return tok.decode([t]) if tok is not None else str(t)

        entries = [dict(zip(lp.token_ids, lp.logprobs)) for lp in msg.logprobs]
        if chat:
            return {
                "content": [
                    {
                        "token": text(t),
                        "logprob": e.get(t),
                        "bytes": list(text(t).encode()),
                        "top_logprobs": [
                            {"token": text(k), "logprob": v, "bytes": list(text(k).encode())}
                            for k, v in sorted(e.items(), key=lambda kv: -kv[1])
                        ],
                    }
                    for t, e in zip(msg.token_ids, entries)
                ]
            }
        return {
            "tokens": [text(t) for t in msg.token_ids],
            "token_logprobs": [e.get(t) for t, e in zip(msg.token_ids, entries)],
            "top_logprobs": [{text(k): v for k, v in e.items()} for e in entries],
            "text_offset": [],
        }


def build_app(api: OpenAIAPI) -> FastAPI:
    app = FastAPI(title="pdserve OpenAI-compatible API", docs_url=None, redoc_url=None)
    app.add_api_route("/v1/completions", api.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", api.chat_completions, methods=["POST"])
    app.add_api_route("/v1/models", api.models, methods=["GET"])
    app.add_api_route("/health", api.health, methods=["GET"])
    add_error_handlers(app)
    return app


def add_error_handlers(app: FastAPI) -> None:
    """Unknown URLs (404) and wrong methods (405) answer in OpenAI's error shape, not FastAPI's
    {"detail": ...}; OpenAI says "Invalid URL (GET /v1/foo)"."""

    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        where = f"{request.method} {request.url.path}"
        if exc.status_code == 404:
            message = f"Invalid URL ({where})"
        elif exc.status_code == 405:
            message = f"Invalid method for URL ({where}): use {(exc.headers or {}).get('Allow', 'another method')}"
        else:
            message = str(exc.detail)
        return JSONResponse(APIError(exc.status_code, message).body(), status_code=exc.status_code, headers=exc.headers)

    app.add_exception_handler(HTTPException, http_error)


async def serve_http(app: FastAPI, host: str, port: int):
    """Runs the app with uvicorn on the current event loop; returns (server, task, bound port).
    Raises OSError when the port cannot be bound (uvicorn itself would exit the process)."""
    import asyncio
    import os
    import socket

    import uvicorn

    try:
        sock = socket.create_server((host, port))
    except OSError as e:
        raise OSError(f"could not serve HTTP on {host}:{port}: {os.strerror(e.errno) if e.errno else e}") from None
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()  # raises why it could not start
        await asyncio.sleep(0.01)
    return server, task, sock.getsockname()[1]


# ---- helpers ------------------------------------------------------------------------------
async def _json(request: Request) -> dict:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise APIError(400, "the request body must be a JSON object") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


def _model(body: dict) -> str:
    model = body.get("model")
    if model is None or model == "":
        raise APIError(400, "you must provide a model parameter", "model")  # OpenAI's words
    if not isinstance(model, str):
        raise APIError(400, f"model must be a string, got {model!r}", "model")
    return model


def _messages(messages) -> list[generate_pb2.ChatMessage]:
    """Chat messages as pdserve's. As in OpenAI's API, an empty string is a valid content (the
    template renders it); a missing or null content, or one that is neither a string nor a list of
    text parts, is refused naming messages[i].content. Roles are checked by the chat template."""
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise APIError(400, f"messages[{i}] must be an object with a role and a content", f"messages[{i}]")
        role = m.get("role")
        if not isinstance(role, str):
            raise APIError(400, f"messages[{i}].role must be a string, got {role!r}", f"messages[{i}].role")
        calls = _message_tool_calls(m.get("tool_calls"), f"messages[{i}].tool_calls")
        content = m.get("content")
        content = "" if content is None and calls else _content(content, f"messages[{i}].content")
        message = generate_pb2.ChatMessage(role=role, content=content, tool_calls=calls)
        for name in ("tool_call_id", "name"):
            value = m.get(name)
            if value is not None and not isinstance(value, str):
                raise APIError(400, f"messages[{i}].{name} must be a string", f"messages[{i}].{name}")
            setattr(message, name, value or "")
        out.append(message)
    return out


def _message_tool_calls(calls, param: str) -> list[generate_pb2.ToolCall]:
    """An assistant message's tool_calls as OpenAI sends them back: [{"id", "type": "function",
    "function": {"name", "arguments": JSON text}}]."""
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise APIError(400, f"{param} must be a list", param)
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        shape = '{"id", "type": "function", "function": {"name", "arguments"}}'
        if (
            not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
            or call.get("type", "function") != "function"
            or not isinstance(call.get("id", ""), str)
        ):
            raise APIError(400, f"{param}[{j}] must be {shape}", f"{param}[{j}]")
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, str):
            raise APIError(400, f"{param}[{j}].function.arguments must be a JSON string", f"{param}[{j}]")
        out.append(generate_pb2.ToolCall(index=j, id=call.get("id", ""), name=function["name"], arguments=arguments))
    return out


def _tools(chat: generate_pb2.ChatMessages, body: dict) -> None:
    """OpenAI's tools ([{"type": "function", "function": {"name", "description", "parameters"}}])
    and tool_choice ("none", "auto", "required" or {"type": "function", "function": {"name"}})."""
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise APIError(400, "tools must be a list of functions", "tools")
        for i, tool in enumerate(tools):
            function = tool.get("function") if isinstance(tool, dict) else None
            if (
                not isinstance(tool, dict)
                or tool.get("type", "function") != "function"
                or not isinstance(function, dict)
            ):
                raise APIError(400, f'tools[{i}] must be {{"type": "function", "function": {{"name", ...}}}}', "tools")
            name, description = function.get("name"), function.get("description") or ""
            parameters = function.get("parameters")
            if not isinstance(name, str) or not isinstance(description, str):
                raise APIError(400, f"tools[{i}].function: name and description must be strings", "tools")
            if parameters is not None and not isinstance(parameters, dict):
                raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema object", "tools")
            chat.tools.add(name=name, description=description, parameters=json.dumps(parameters) if parameters else "")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None:
        if not isinstance(parallel, bool):
            raise APIError(400, "parallel_tool_calls must be a boolean", "parallel_tool_calls")
        chat.parallel_tool_calls = parallel
    choice = body.get("tool_choice")
    if choice is None:
        return
    if isinstance(choice, str):
        chat.tool_choice_mode = choice  # checked beside the tools, for both APIs
    elif (
        isinstance(choice, dict)
        and isinstance(choice.get("function"), dict)
        and isinstance(choice["function"].get("name"), str)
    ):
        chat.tool_choice_function = choice["function"]["name"]
    else:
        raise APIError(
            400,
            'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name"}}',
            "tool_choice",
        )


def _penalties(sampling: common_pb2.SamplingParams, body: dict) -> None:
    """logit_bias ({"token id": bias}, OpenAI's JSON) and bad_words (vLLM's strings, tokenized by the frontend)."""
    bias = body.get("logit_bias") or {}
    if not isinstance(bias, dict):
        raise APIError(400, 'logit_bias must be an object of {"token id": bias}', "logit_bias")
    for token, value in bias.items():
        try:
            token_id = int(token)
        except (TypeError, ValueError):
            raise APIError(400, f"logit_bias: {token!r} is not a token id", "logit_bias") from None
        if not 0 <= token_id < 2**31:
            raise APIError(400, f"logit_bias: token id {token_id} is out of range", "logit_bias")
        sampling.logit_bias[token_id] = _typed("logit_bias", value, float)
    words = body.get("bad_words") or []
    if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
        raise APIError(400, "bad_words must be a list of strings", "bad_words")
    sampling.bad_words.extend(words)


def _structured_output(sampling: common_pb2.SamplingParams, body: dict) -> None:
    """OpenAI's response_format (json_object, json_schema), vLLM's structured_outputs {json, regex,
    choice, grammar, json_object} and guided_json/regex/choice/grammar: at most one of them."""
    asked = []
    fmt = body.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
            raise APIError(400, "response_format.type must be text, json_object or json_schema", "response_format")
        if fmt["type"] == "json_object":
            asked.append(("response_format", "json_object", ""))
        elif fmt["type"] == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise APIError(
                    400, "response_format.json_schema.schema must be a JSON schema object", "response_format"
                )
            asked.append(("response_format", "json_schema", json.dumps(spec["schema"])))
    extension = body.get("structured_outputs")
    if extension is not None:
        if not isinstance(extension, dict):
            raise APIError(400, "structured_outputs must be an object", "structured_outputs")
        unknown = sorted(set(extension) - set(STRUCTURED_KEYS) - {"json_object"})
        if unknown:
            known = sorted((*STRUCTURED_KEYS, "json_object"))
            message = f"structured_outputs: {unknown} not supported; supported: {known}"
            raise APIError(400, message, "structured_outputs")
        if extension.get("json_object"):
            asked.append(("structured_outputs", "json_object", ""))
        asked += [("structured_outputs", STRUCTURED_KEYS[k], v) for k, v in extension.items() if k in STRUCTURED_KEYS]
    asked += [
        (f"guided_{k}", STRUCTURED_KEYS[k], body[f"guided_{k}"]) for k in STRUCTURED_KEYS if f"guided_{k}" in body
    ]
    asked = [(field, kind, spec) for field, kind, spec in asked if spec is not None]
    if not asked:
        return
    if len(asked) > 1:
        raise APIError(400, f"{asked[1][0]}: only one structured output per request", asked[1][0])
    field, kind, spec = asked[0]
    if kind in ("json_schema", "choice") and not isinstance(spec, str):
        spec = json.dumps(spec)
    if not isinstance(spec, str):
        raise APIError(400, f"{field}: the {kind} must be a string", field)
    sampling.structured_output.kind, sampling.structured_output.spec = kind, spec


def _message(text: str, calls) -> dict:
    """A chat choice's message: with tool calls, content is null unless the model also wrote some."""
    if not calls:
        return {"role": "assistant", "content": text}
    return {
        "role": "assistant",
        "content": text if text.strip() else None,
        "tool_calls": [_tool_call(c) for c in calls],
    }


def _tool_call(c: generate_pb2.ToolCall) -> dict:
    """A streamed call's fragment: index, id, type and name on its first, index and arguments after."""
    if not c.id:
        return {"index": c.index, "function": {"arguments": c.arguments}}
    return {"index": c.index, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}


def _typed(name: str, value, kind):
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or (kind is int and not float(value).is_integer())
    ):
        raise APIError(400, f"{name} must be {'an integer' if kind is int else 'a number'}, got {value!r}", name)
    if kind is int and not -(2**31) <= value < 2**31:
        raise APIError(400, f"{name} is out of range: {value!r}", name)
    return kind(value)


def _content(content, param: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str) for part in content
    ):
        return "".join(part["text"] for part in content)  # [{"type": "text", "text": ...}, ...]
    given = "it is missing or null" if content is None else f"got {json.dumps(content)[:200]}"
    raise APIError(
        400,
        f"{param} must be a string (it may be empty) or a list of text parts "
        f'[{{"type": "text", "text": ...}}]; {given}',
        param,
    )


def _api_error(e: RequestError, body: dict) -> APIError:
    """The frontend's error in OpenAI's shape; `param` names the field as the client sent it (the
    frontend's structured_output is whichever of response_format, structured_outputs, guided_* it was)."""
    status = HTTP_STATUS.get(e.code, 500)
    code = "model_not_found" if e.code == grpc.StatusCode.NOT_FOUND else None
    param = _param_of(e.details)
    if param == "structured_output":
        asked = [f for f in STRUCTURED_FIELDS if body.get(f) not in (None, {"type": "text"})]
        param = asked[0] if asked else param
    return APIError(status, e.details, param, code)


def _param_of(message: str) -> str | None:
    """The field an error message names first (see PARAMS), else None."""
    head = message.split(" ", 1)[0].rstrip(":")
    if head in PARAMS or re.fullmatch(r"messages\[\d+\](\.\w+|\[\d+\])*", head):
        return head
    return "tools" if re.fullmatch(r"tools\[\d+\](\.\w+)*", head) else None


def _stream_options(body: dict, stream: bool) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats). As in OpenAI's API, stream_options needs stream.
    continuous_usage_stats is vLLM's extension; vLLM ignores it without include_usage, here it
    implies include_usage (a client asking for usage on every chunk wants the final one too, and
    an option accepted must not be silently ignored)."""
    options = body.get("stream_options")
    if options is None:
        return False, False
    if not stream:
        raise APIError(400, "stream_options is only allowed when stream is true", "stream_options")
    if not isinstance(options, dict):
        raise APIError(400, f"stream_options must be an object, got {json.dumps(options)[:200]}", "stream_options")
    flags = []
    for name in ("include_usage", "continuous_usage_stats"):
        value = options.get(name)
        if value is not None and not isinstance(value, bool):
            raise APIError(
                400, f"stream_options.{name} must be a boolean, got {json.dumps(value)[:200]}", f"stream_options.{name}"
            )
        flags.append(bool(value))
    include_usage, continuous = flags
    return include_usage or continuous, continuous


def _usage(u: common_pb2.Usage, t: common_pb2.Timings) -> dict:
    """OpenAI's usage; cached_tokens: prompt tokens whose KV the prefix cache of the node that ran
    the prefill held (a prefill node, or the decode node for a local prefill), i.e. not computed
    for this request. t.decode_cached_tokens is not added: those tokens only skipped the transfer
    to the decode node, the prefill node still computed (or itself cached) them."""
    return {
        **_running_usage(u.prompt_tokens, u.completion_tokens),
        "prompt_tokens_details": {"cached_tokens": t.cached_tokens},
    }


def _running_usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


def _deadline(request: Request) -> float:
    timeout = request.headers.get("x-request-timeout")
    try:
        return time.time() + float(timeout) if timeout else 0.0
    except ValueError:
        return 0.0

"""Tool calling: OpenAI's `tools` and `tool_choice` on any chat model, over the gRPC API and the
OpenAI one alike (the router's frontend applies it; the nodes only see a prompt and, for the
constrained choices, a structured output).

The tools are rendered by the model's chat template, in its own tool format. Then, by tool_choice:
  none      the output is plain content;
  auto      the output is parsed for calls in the model family's format, by a parser per format
            (hermes: Qwen and others' <tool_call>{...}</tool_call>; llama3_json: Llama 3's
            {"name", "parameters"}; mistral: [TOOL_CALLS][...]), picked from the chat template or
            named by --tool-call-parser;
  required  the output is held (structured output) to a JSON list of one or more calls of the
            given tools, [{"name": ..., "parameters": {...}}, ...], as vLLM does;
  a name    the output is held to that function's parameters schema: it is the call's arguments.
Calls leave as ToolCall fragments, as OpenAI streams them: index, id and name on a call's first,
arguments appended after; the text keeps only what is not a call. A sample that called a tool and
stopped finishes with "tool_calls"; one cut by max_tokens keeps "length", and an unfinished
constrained call stays text (never invalid JSON claimed as a call).
"""

from __future__ import annotations

import json
import random
import re
import string
import uuid
from dataclasses import dataclass

from pdserve_api import common_pb2, generate_pb2

TOOL_CHOICES = ("none", "auto", "required")
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "mistral")  # auto: the one the chat template's format names
MAX_TOOLS = 128
NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass
class Call:
    """A fragment of a sample's call number `index`: id and name on its first, arguments (JSON text) after."""

    index: int
    arguments: str = ""
    id: str = ""
    name: str = ""


def new_call(index: int, name: str, arguments: str = "") -> Call:
    return Call(index, arguments, f"call_{uuid.uuid4().hex[:24]}", name)


def mistral_call_id() -> str:
    """Mistral's templates take back only ids of 9 letters and digits."""
    return "".join(random.SystemRandom().choices(string.ascii_letters + string.digits, k=9))


# ---- the request side: tools checked, rendered, constrained -------------------------------------
def template_tools(chat: generate_pb2.ChatMessages) -> list[dict] | None:
    """The request's tools as chat templates take them (OpenAI's shape); raises ValueError naming
    tools[i].function.<field> or tool_choice where one is malformed."""
    kind, mode = chat.WhichOneof("tool_choice"), chat.tool_choice_mode
    if kind == "tool_choice_mode" and mode not in TOOL_CHOICES:
        raise ValueError(f"tool_choice must be one of {TOOL_CHOICES} or a function, got {mode!r}")
    if not chat.tools:
        if kind is not None and tool_choice(chat) != "none":
            raise ValueError(f"tool_choice: {tool_choice(chat)} needs tools, and the request has none")
        return None
    if len(chat.tools) > MAX_TOOLS:
        raise ValueError(f"tools: at most {MAX_TOOLS} tools per request, got {len(chat.tools)}")
    out, names = [], set()
    for i, tool in enumerate(chat.tools):
        where = f"tools[{i}].function"
        if not NAME.fullmatch(tool.name):
            raise ValueError(f"{where}.name must match [a-zA-Z0-9_-]{{1,64}}, got {tool.name!r}")
        if tool.name in names:
            raise ValueError(f"{where}.name: {tool.name!r} is named twice")
        names.add(tool.name)
        parameters = NO_PARAMETERS
        if tool.parameters:
            try:
                parameters = json.loads(tool.parameters)
            except ValueError as e:
                raise ValueError(f"{where}.parameters is not valid JSON ({e})") from None
            if not isinstance(parameters, dict):
                raise ValueError(f"{where}.parameters must be a JSON schema object")
        function = {"name": tool.name, "description": tool.description} if tool.description else {"name": tool.name}
        function["parameters"] = parameters  # OpenAI's order, as templates print it
        out.append({"type": "function", "function": function})
    named = chat.tool_choice_function
    if named and named not in names:
        raise ValueError(f"tool_choice: no tool named {named!r} (tools: {sorted(names)})")
    return out


def tool_choice(chat: generate_pb2.ChatMessages) -> str:
    """none, auto, required, or "function" (a named one)."""
    kind = chat.WhichOneof("tool_choice")
    if kind == "tool_choice_function":
        return "function"
    if kind == "tool_choice_mode":
        return chat.tool_choice_mode
    return "auto" if chat.tools else "none"


def parallel(chat: generate_pb2.ChatMessages) -> bool:
    """parallel_tool_calls: whether a sample may make more than one call (OpenAI's default: yes)."""
    return not chat.HasField("parallel_tool_calls") or chat.parallel_tool_calls


def constrained_output(chat: generate_pb2.ChatMessages) -> common_pb2.StructuredOutput | None:
    """The structured output that holds a required or named call to its schema (None otherwise)."""
    choice = tool_choice(chat)
    tools = template_tools(chat)
    if choice == "function":
        (tool,) = [t["function"] for t in tools if t["function"]["name"] == chat.tool_choice_function]
        return common_pb2.StructuredOutput(kind="json_schema", spec=json.dumps(tool["parameters"]))
    if choice != "required":
        return None
    calls, defs = [], {}
    for t in tools:  # each schema's definitions hoisted to the list's top, where its "#/$defs/..." point
        parameters = dict(t["function"]["parameters"])
        for key in ("$defs", "definitions"):
            for name, definition in (parameters.pop(key, None) or {}).items():
                if defs.setdefault(key, {}).setdefault(name, definition) != definition:
                    raise ValueError(f"tools: two functions define {key}/{name} differently (tool_choice required)")
        calls.append(
            {
                "type": "object",
                "properties": {"name": {"const": t["function"]["name"]}, "parameters": parameters},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}, **defs}
    if not parallel(chat):
        schema["maxItems"] = 1
    return common_pb2.StructuredOutput(kind="json_schema", spec=json.dumps(schema))


def template_messages(chat: generate_pb2.ChatMessages) -> list[dict]:
    """The messages as chat templates take them: an assistant's calls with their arguments as
    objects (what Hugging Face templates expect, as vLLM passes them), a tool message's call id."""
    out = []
    for i, m in enumerate(chat.messages):
        message: dict = {"role": m.role, "content": m.content}
        if m.tool_calls:
            calls = []
            for j, c in enumerate(m.tool_calls):
                try:
                    arguments = json.loads(c.arguments or "{}")
                except ValueError as e:
                    where = f"messages[{i}].tool_calls[{j}].function.arguments"
                    raise ValueError(f"{where} is not valid JSON ({e})") from None
                calls.append({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": arguments}})
            message["tool_calls"] = calls
        if m.role == "tool" and not m.tool_call_id:
            raise ValueError(f"messages[{i}].tool_call_id: a tool message names the call it answers")
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        if m.name:
            message["name"] = m.name
        out.append(message)
    return out


def parser_for_template(template: str | None) -> str | None:
    """The tool-call format a chat template teaches its model, by the markers it writes."""
    template = template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or ("ipython" in template and "parameters" in template):
        return "llama3_json"
    return None


# ---- the output side: text split into content and calls, as it streams ---------------------------
class ToolParser:
    """Splits one sample's text, as it streams, into content and calls. feed() takes each new
    piece of text and returns (content, calls) ready to send; end() flushes what was held back."""

    def __init__(self):
        self.num_calls = 0

    def feed(self, text: str) -> tuple[str, list[Call]]:
        raise NotImplementedError

    def end(self) -> tuple[str, list[Call]]:
        raise NotImplementedError

    def _calls(self, found: list[tuple[str, object]]) -> list[Call]:
        calls = []
        for name, arguments in found:
            text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
            calls.append(new_call(self.num_calls, name, text))
            self.num_calls += 1
        return calls


class NamedParser(ToolParser):
    """tool_choice a function: the whole output is its arguments, streamed as they come."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def feed(self, text):
        if not text:
            return "", []
        if self.num_calls == 0:
            self.num_calls = 1
            return "", [new_call(0, self.name, text)]
        return "", [Call(0, text)]

    def end(self):
        return "", []


class HeldParser(ToolParser):
    """Formats whose calls are known only once the output ends: content before the calls streams,
    the calls are held and parsed at the end (and stay text if they do not parse)."""

    markers: tuple[str, ...] = ()  # where calls begin anywhere in the text
    openings: tuple[str, ...] = ()  # where calls begin when the output (less whitespace) starts so

    def __init__(self):
        super().__init__()
        self.held, self.holding, self.started = "", False, False

    def feed(self, text):
        self.held += text
        if self.holding:
            return "", []
        if not self.started:  # the output's opening decides, once it is known (whitespace aside: "[ {")
            head = "".join(self.held[:64].split())
            if any(head.startswith(o) for o in self.openings):
                self.holding = True
                return "", []
            if not head or any(o.startswith(head) for o in self.openings):
                return "", []
            self.started = True
        for marker in self.markers:
            at = self.held.find(marker)
            if at >= 0:
                content, self.held, self.holding = self.held[:at], self.held[at:], True
                return content, []
        keep = max((_prefix_overlap(self.held, m) for m in self.markers), default=0)
        content, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        return content, []

    def end(self):
        held, self.held = self.held, ""
        found = self.parse(held) if self.holding else None
        return ("", self._calls(found)) if found else (held, [])

    def parse(self, text: str) -> list[tuple[str, object]] | None:
        raise NotImplementedError


class RequiredParser(HeldParser):
    """tool_choice required: the output is [{"name", "parameters"}, ...] (held so by its schema)."""

    def feed(self, text):
        self.held, self.holding = self.held + text, True
        return "", []

    def parse(self, text):
        try:
            calls = json.loads(text)
        except ValueError:
            return None  # cut short
        if not isinstance(calls, list) or not all(
            isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls
        ):
            return None
        return [(c["name"], c.get("parameters", {})) for c in calls]


class HermesParser(ToolParser):
    """<tool_call>{"name": ..., "arguments": {...}}</tool_call>, any number, content around them
    (Qwen 2.5 / 3, Hermes, SmolLM3 and others): each call is sent as soon as its tag closes."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self):
        super().__init__()
        self.held, self.inside = "", False

    def feed(self, text):
        self.held += text
        content, calls = "", []
        while True:
            if not self.inside:
                at = self.held.find(self.START)
                if at < 0:
                    keep = _prefix_overlap(self.held, self.START)
                    content += self.held[: len(self.held) - keep]
                    self.held = self.held[len(self.held) - keep :]
                    return content, calls
                content += self.held[:at]
                self.held, self.inside = self.held[at + len(self.START) :], True
            else:
                at = self.held.find(self.END)
                if at < 0:
                    return content, calls
                body, self.held, self.inside = self.held[:at], self.held[at + len(self.END) :], False
                call = _hermes_call(body)
                if call is None:
                    content += self.START + body + self.END  # not a call: the text stands
                else:
                    calls += self._calls([call])

    def end(self):
        held, self.held = self.held, ""
        if not self.inside:
            return held, []
        self.inside = False
        call = _hermes_call(held)  # stopped before its closing tag (the stop token ended it)
        return ("", self._calls([call])) if call is not None else (self.START + held, [])


class Llama3JsonParser(HeldParser):
    """Llama 3.1+'s JSON calls: the output is {"name": ..., "parameters": {...}} (after
    <|python_tag|> where the text keeps it), several separated by ';'. Other output is content."""

    openings = ("<|python_tag|>", "{")

    def parse(self, text):
        found = []
        for value in _json_values(text.strip().removeprefix("<|python_tag|>"), separators=";"):
            if not isinstance(value, dict) or not isinstance(value.get("name"), str):
                return None
            found.append((value["name"], value.get("parameters", value.get("arguments", {}))))
        return found or None


class MistralParser(HeldParser):
    """Mistral's [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...] after any content (where the
    marker, a special token, is gone from the text: an output that opens as a JSON list of calls)."""

    markers = ("[TOOL_CALLS]",)
    openings = ("[{",)

    def parse(self, text):
        values = _json_values(text.strip().removeprefix("[TOOL_CALLS]"))
        if len(values) != 1 or not isinstance(values[0], list):
            return None
        calls = values[0]
        if not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
            return None
        return [(c["name"], c.get("arguments", c.get("parameters", {}))) for c in calls] or None


PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser, "mistral": MistralParser}


class ToolCalls:
    """A request's tool calls, per sample: rewrites each GenerateResponse in place (text: the
    content; tool_calls: the call fragments; finish_reason tool_calls for a sample that called)."""

    def __init__(self, make_parser, max_calls: int | None = None, mistral_ids: bool = False):
        """max_calls: calls past it are dropped (parallel_tool_calls false under auto); mistral_ids:
        ids a Mistral template takes back."""
        self.make_parser, self.max_calls, self.mistral_ids = make_parser, max_calls, mistral_ids
        self.parsers: dict[int, ToolParser] = {}

    def rewrite(self, msg: generate_pb2.GenerateResponse) -> None:
        parser = self.parsers.get(msg.index) or self.parsers.setdefault(msg.index, self.make_parser())
        content, calls = parser.feed(msg.text)
        if msg.finish_reason:
            more, later = parser.end() if msg.finish_reason == "stop" else _unparsed(parser)
            content, calls = content + more, calls + later
            if parser.num_calls and msg.finish_reason == "stop":
                msg.finish_reason = "tool_calls"
        msg.text = content
        if self.max_calls is not None:
            calls = [c for c in calls if c.index < self.max_calls]
        for c in calls:
            if c.id and self.mistral_ids:
                c.id = mistral_call_id()
        msg.tool_calls.extend(
            generate_pb2.ToolCall(index=c.index, id=c.id, name=c.name, arguments=c.arguments) for c in calls
        )


def tool_calls_for(chat: generate_pb2.ChatMessages, parser: str, template: str | None) -> ToolCalls | None:
    """The request's ToolCalls (None without tools or with tool_choice none); raises ValueError
    naming what is wrong (an auto choice on a template whose format no parser knows included)."""
    template_tools(chat)
    choice = tool_choice(chat)
    if choice == "none":
        return None
    mistral = parser_for_template(template) == "mistral"
    if choice == "function":
        return ToolCalls(lambda: NamedParser(chat.tool_choice_function), mistral_ids=mistral)
    if choice == "required":
        return ToolCalls(RequiredParser, mistral_ids=mistral)
    name = parser if parser != "auto" else parser_for_template(template)
    if name is None:
        raise ValueError(
            "tool_choice: auto needs a tool-call format, and this model's chat template shows none pdserve "
            f"knows ({', '.join(PARSERS)}); start the router with --tool-call-parser, or ask for "
            "tool_choice required or a named function"
        )
    return ToolCalls(PARSERS[name], None if parallel(chat) else 1, mistral_ids=mistral or name == "mistral")


def join_fragments(parts) -> list[generate_pb2.ToolCall]:
    """Call fragments with each call's run together: its first (index, id, name) takes the arguments
    of the fragments after it (a unary answer's whole calls; a stream's messages merged)."""
    out: list[generate_pb2.ToolCall] = []
    for part in parts:
        if out and not part.id and out[-1].index == part.index:
            out[-1].arguments += part.arguments
        else:
            out.append(generate_pb2.ToolCall(index=part.index, id=part.id, name=part.name, arguments=part.arguments))
    return out


# ---- helpers ------------------------------------------------------------------------------
def _unparsed(parser: ToolParser) -> tuple[str, list[Call]]:
    """A sample cut short (length, abort): a named call keeps its partial arguments (as OpenAI's
    do); everything held back by other parsers is content, not a call."""
    if isinstance(parser, NamedParser):
        return "", []
    if isinstance(parser, HermesParser):
        held = (HermesParser.START if parser.inside else "") + parser.held
        parser.held, parser.inside = "", False
        return held, []
    held, parser.held = parser.held, ""
    return held, []


def _prefix_overlap(text: str, marker: str) -> int:
    """How many of text's last characters begin marker (text held back until it is known)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _hermes_call(body: str) -> tuple[str, object] | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    return value["name"], value.get("arguments", value.get("parameters", {}))


def _json_values(text: str, separators: str = "") -> list:
    """The JSON values text holds one after another (whitespace and separators between them);
    [] where it holds anything else."""
    decoder, values, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and (text[at].isspace() or text[at] in separators):
            at += 1
        if at == len(text):
            return values
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return []
        values.append(value)

"""Tokenizer loading and the chat-template helper."""

from __future__ import annotations

from pathlib import Path

from engine.sampling_params import MAX_BAD_WORDS

ROLES = ("system", "user", "assistant", "tool")


def load_tokenizer(model_dir: Path):
    """The checkpoint's tokenizer, or None when it ships without one (token-id prompts only)."""
    model_dir = Path(model_dir)
    if not any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def apply_chat_template(
    tokenizer, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
) -> str:
    """Renders chat messages ({"role", "content"}, an assistant's "tool_calls", a tool message's
    "tool_call_id") and the tools (OpenAI's {"type": "function", "function": {...}}) with the
    model's own template."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("messages: this model has no chat template; send a plain prompt instead")
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}] must have a role in {ROLES} and a string content, got {m!r}")
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except TemplateError as e:  # the template's own raise_exception(...), or a template that does not render
        raise ValueError(f"messages: the chat template refused them: {e}") from None


def prompt_token_ids(tokenizer, prompt: str | list[int], vocab_size: int) -> list[int]:
    """Validates a prompt (text or token ids) and returns its token ids."""
    if isinstance(prompt, str):
        if prompt == "":
            raise ValueError("prompt must not be empty")
        if tokenizer is None:
            raise ValueError("prompt: this model has no tokenizer; pass token ids")
        return tokenizer.encode(prompt, add_special_tokens=False)
    ids = list(prompt)
    if not ids:
        raise ValueError("prompt must not be empty")
    bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids must be integers in [0, {vocab_size}), got {bad[:5]}")
    return ids


def check_prompt_length(num_tokens: int, max_model_len: int) -> None:
    if num_tokens >= max_model_len:
        raise ValueError(
            f"prompt has {num_tokens} tokens; it must be shorter than max_model_len "
            f"({max_model_len}) to leave room for one generated token"
        )


def bad_words_token_ids(tokenizer, words: list[str]) -> tuple[tuple[int, ...], ...]:
    """Each bad word's token ids as it starts the text and, where that tokenizes otherwise, as it
    follows a space (vLLM's two spellings of a word)."""
    if tokenizer is None:
        raise ValueError("bad_words: this engine has no tokenizer (send bad_words_token_ids)")
    if len(words) > MAX_BAD_WORDS:
        raise ValueError(f"bad_words: at most {MAX_BAD_WORDS} words, got {len(words)}")
    out: list[tuple[int, ...]] = []
    for word in words:
        if not isinstance(word, str) or not word.strip():
            raise ValueError(f"bad_words must be non-empty strings, got {word!r}")
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in out:
                out.append(ids)
    return tuple(out)

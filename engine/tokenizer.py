"""Tokenizer loading and the chat-template helper."""

from __future__ import annotations

from pathlib import Path

ROLES = ("system", "user", "assistant", "tool")


def load_tokenizer(model_dir: Path):
    """The checkpoint's tokenizer, or None when it ships without one (token-id prompts only)."""
    model_dir = Path(model_dir)
    if not any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def apply_chat_template(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """Renders chat messages ({"role", "content"}) with the model's own template."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("messages: this model has no chat template; send a plain prompt instead")
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}] must have a role in {ROLES} and a string content, got {m!r}")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

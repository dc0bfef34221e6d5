"""The offline API: `LLM(model=...).generate(prompts, params)`, as in vLLM."""

from __future__ import annotations

import itertools

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_source import DEFAULT_MODEL
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.tokenizer import apply_chat_template

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, **engine_args):
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: Prompt | list[Prompt],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Runs the prompts to completion with continuous batching; outputs in prompt order.
        Every prompt is checked before any runs; a bad one raises ValueError naming its index."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise ValueError("prompts must not be empty")
        params = params if params is not None else SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"params: got {len(params)} SamplingParams for {len(prompts)} prompts")
        token_ids = []
        for i, prompt in enumerate(prompts):
            try:
                ids = self.engine.tokenize(prompt)
                self.engine._check_length(len(ids))
            except ValueError as e:
                raise ValueError(f"prompts[{i}]: {e}") from None
            token_ids.append(ids)
        request_ids = [f"offline-{next(self._ids)}" for _ in prompts]
        for request_id, ids, p in zip(request_ids, token_ids, params):
            self.engine.add_request(request_id, ids, p)
        done: dict[str, RequestOutput] = {}
        while len(done) < len(request_ids):
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[r] for r in request_ids]

    def chat(self, messages: list[dict] | list[list[dict]],
             params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Like generate, for chat conversations rendered with the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate([apply_chat_template(self.tokenizer, c) for c in conversations], params)

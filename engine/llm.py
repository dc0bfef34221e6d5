"""The offline API: `LLM(model=...).generate(prompts, params)`, as in vLLM."""

from __future__ import annotations

import itertools
from dataclasses import replace

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

    def generate(
        self, prompts: Prompt | list[Prompt], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Runs the prompts to completion with continuous batching; outputs in prompt order (with
        n > 1, each output is sample 0 and holds all n in `.samples`).
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
        samples: dict[str, list[RequestOutput]] = {r: [] for r in request_ids}
        want = dict(zip(request_ids, (p.n for p in params)))
        remaining = len(request_ids)
        while remaining:
            for out in self.engine.step():
                if out.finished:
                    samples[out.request_id].append(out)
                    remaining -= len(samples[out.request_id]) == want[out.request_id]
        results = []
        for r in request_ids:  # with n > 1: sample 0, all of them in .samples
            outs = sorted(samples[r], key=lambda o: o.index)
            results.append(outs[0] if len(outs) == 1 else replace(outs[0], samples=outs))
        return results

    def chat(
        self, messages: list[dict] | list[list[dict]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Like generate, for chat conversations rendered with the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate([apply_chat_template(self.tokenizer, c) for c in conversations], params)

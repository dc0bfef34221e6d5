"""Beam search, with transformers' rules (`generate(num_beams=W, do_sample=False)`, its defaults:
length_penalty 1.0, early_stopping False), so the hypotheses are the same.

Each step every running beam is one single-token request to the engine (prompt + the beam's
tokens, max_tokens 1, the top 2W log-probabilities of the next token): the prefix cache hands each
one the KV of its full blocks, shared by reference count with the other beams and the steps before
(transformers reorders a dense cache instead), so a step computes only the tokens past the last
full block. Of the 2W best continuations over all beams (beam score + token logprob), those ending
in EOS among the first W become finished hypotheses, scored sum / generated_length ** length_penalty;
the first W others run on. The search ends when W hypotheses are finished and the best running
beam, scored at its current length, cannot beat the worst of them, or at max_tokens (every
candidate then finishes).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.outputs import RequestOutput
from engine.sampler import MASKED_LOGPROB
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

NOT_YET = -1.0e9  # transformers' score of an empty hypothesis slot


@dataclass
class Beam:
    token_ids: list[int]
    score: float  # sum of the tokens' log-probabilities


@dataclass
class Hypothesis:
    token_ids: list[int]
    logprob: float  # sum of the tokens' log-probabilities
    score: float  # logprob / len ** length_penalty


class BeamSearch:
    def __init__(self, params: SamplingParams, stop_token_ids: frozenset[int]):
        self.params = params
        self.width = params.beam_width
        self.stop_token_ids = stop_token_ids
        self.running = [Beam([], 0.0)]
        self.finished: list[Hypothesis] = []
        self.improvable = True  # transformers' early-stop heuristic not yet satisfied
        self.done = False

    def step_params(self) -> SamplingParams:
        """What each beam's single-token request asks for (under a grammar, the masked distribution's
        log-probabilities: EOS among them only where the beam's tokens may end)."""
        so = self.params.structured_output
        return SamplingParams(
            max_tokens=1, temperature=0, ignore_eos=so is None, logprobs=2 * self.width, structured_output=so
        )

    def advance(self, next_logprobs: list[dict[int, float]]) -> None:
        """next_logprobs[b]: the top log-probabilities of the token after running beam b."""
        width, penalty = self.width, self.params.length_penalty
        candidates = sorted(
            (
                (beam.score + lp, b, token)
                for b, beam in enumerate(self.running)
                for token, lp in next_logprobs[b].items()
                if lp > MASKED_LOGPROB  # a token the beam's grammar refuses is no candidate
            ),
            key=lambda c: -c[0],
        )[: 2 * width]
        length = len(self.running[0].token_ids) + 1  # every beam has as many tokens
        at_max = length >= self.params.max_tokens
        hits = [at_max or token in self.stop_token_ids for _, _, token in candidates]
        # finished: the first W candidates that end here (none once no improvement is possible)
        if self.improvable:
            for (score, b, token), hit in zip(candidates[:width], hits[:width]):
                if hit:
                    self.finished.append(
                        Hypothesis(self.running[b].token_ids + [token], score, score / length**penalty)
                    )
            self.finished = sorted(self.finished, key=lambda h: -h.score)[:width]  # stable: earlier first
        # running: the first W candidates that go on
        self.running = [
            Beam(self.running[b].token_ids + [token], score)
            for (score, b, token), hit in zip(candidates, hits)
            if not hit
        ][:width]
        if self.running and len(self.finished) == width:
            best_possible = self.running[0].score / length**penalty
            self.improvable = self.improvable and best_possible > min(h.score for h in self.finished)
        self.done = not self.improvable or all(hits) or not self.running

    def results(self) -> list[Hypothesis]:
        """The W hypotheses, best first."""
        return self.finished


BEAM_INDEX = 1 << 20  # sequence index of running beam b: BEAM_INDEX + b (a request's samples count from 0)


class BeamRequest:
    """One beam search request inside the engine: the single-token sequences of each step, the
    step's results as they come in, and the final outputs."""

    def __init__(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, stop_token_ids: frozenset[int]
    ):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.search = BeamSearch(params, stop_token_ids)
        self.pending: dict[int, dict[int, float]] = {}  # running beam -> its next-token logprobs
        self.num_cached_tokens = 0

    def step_sequences(self) -> list[Sequence]:
        params = self.search.step_params()
        return [
            Sequence(
                self.request_id,
                self.prompt_token_ids + beam.token_ids,
                params,
                index=BEAM_INDEX + b,
                grammar_prefix=len(beam.token_ids),
            )
            for b, beam in enumerate(self.search.running)
        ]

    def collect(self, out: RequestOutput) -> bool:
        """Takes one beam's step result; True once every running beam's is in (the step is done)."""
        if out.index == BEAM_INDEX:
            self.num_cached_tokens = self.num_cached_tokens or out.num_cached_tokens
        # a beam whose grammar failed (finish_reason "error") has no continuation: it drops out
        self.pending[out.index - BEAM_INDEX] = {} if out.finish_reason == "error" else out.logprobs[-1]
        if len(self.pending) < len(self.search.running):
            return False
        self.search.advance([self.pending[b] for b in range(len(self.search.running))])
        self.pending = {}
        return True

    def outputs(self, detokenize) -> list[RequestOutput]:
        results = self.search.results()
        if not results:  # every beam's grammar failed before any hypothesis finished
            return [
                RequestOutput(
                    request_id=self.request_id,
                    prompt_token_ids=self.prompt_token_ids,
                    token_ids=[],
                    text="",
                    finished=True,
                    finish_reason="error",
                    num_cached_tokens=self.num_cached_tokens,
                    request_finished=True,
                )
            ]
        outs = []
        for i, h in enumerate(results):
            text = detokenize(self.prompt_token_ids, h.token_ids)
            reason = "stop" if h.token_ids[-1] in self.search.stop_token_ids else "length"
            outs.append(
                RequestOutput(
                    request_id=self.request_id,
                    prompt_token_ids=self.prompt_token_ids,
                    token_ids=h.token_ids,
                    text=text,
                    new_token_ids=list(h.token_ids),
                    new_text=text,
                    finished=True,
                    finish_reason=reason,
                    num_cached_tokens=self.num_cached_tokens,
                    index=i,
                    cumulative_logprob=h.logprob,
                    request_finished=i == len(results) - 1,
                )
            )
        return outs

"""The engine: add requests, step, read outputs. One step is schedule -> execute -> postprocess.

It also keeps a finished prefill's KV under a kv_lease (the prefill side of a disaggregated
request) and admits a sequence whose prompt KV was computed elsewhere (the decode side).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.beam_search import BEAM_INDEX, BeamRequest
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.draft_proposer import DraftModelProposer
from engine.hardware import resolve_device, resolve_dtype
from engine.host_memory import keep_freed_buffers
from engine.kv_progress import LayerProgress
from engine.model_config import ModelConfig
from engine.model_runner import ModelRunner
from engine.model_source import resolve_model
from engine.outputs import RequestOutput
from engine.parallel_sampling import SampleGroup, fork
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import FinishReason, Sequence
from engine.speculative import NgramProposer, SpeculativeConfig
from engine.step_log import StepLog
from engine.structured_output import GrammarCompiler, StructuredOutput
from engine.tokenizer import check_prompt_length, load_tokenizer, prompt_token_ids


@dataclass
class KVLease:
    """A finished prefill's blocks, held until the decode side has read them."""

    block_table: list[int]
    num_tokens: int


class LLMEngine:
    def __init__(self, config: EngineConfig, kv_allocator: Callable[[int], torch.Tensor] | None = None):
        """kv_allocator(nbytes) -> a uint8 tensor to hold the KV cache (e.g. in shared memory), or
        None; without one (or None) the KV cache is allocated on the device."""
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.model_dir = resolve_model(config.model)
        self.model_config = cfg = ModelConfig.from_dir(self.model_dir)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        max_model_len = config.max_model_len or cfg.max_position_embeddings
        if max_model_len > cfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len must be <= the model's max_position_embeddings "
                f"({cfg.max_position_embeddings}), got {max_model_len}"
            )
        self.model_config = cfg = cfg.for_context(max_model_len)
        self.runner = ModelRunner(cfg, self.model_dir, config, self.dtype, self.device, max_model_len, kv_allocator)
        self.runner.grammars = GrammarCompiler(self.tokenizer, cfg.vocab_size, cfg.eos_token_ids)
        self.kv_cache = self.runner.kv_cache
        if self.device.type == "cpu":  # after the weights' load: its temporaries go back to the kernel
            keep_freed_buffers()
        self.numerics = self.runner.numerics  # what decides the KV's bits (KVLayout.numerics)
        self.block_manager = BlockManager(self.kv_cache.num_blocks, config.block_size, config.enable_prefix_caching)
        # A sequence can never outgrow the whole KV pool.
        self.max_model_len = min(max_model_len, self.kv_cache.num_blocks * config.block_size)
        self.scheduler = Scheduler(config, self.block_manager, self.max_model_len, cfg.eos_token_ids)
        # (request_id, sample index) -> its sequence and detokenizer
        self.requests: dict[tuple[str, int], tuple[Sequence, IncrementalDetokenizer | None]] = {}
        self.groups: dict[str, SampleGroup] = {}  # requests with several samples (n, best_of)
        self.beams: dict[str, BeamRequest] = {}  # beam search requests (engine/beam_search.py)
        self.kv_leases: dict[str, KVLease] = {}
        self.num_generated_tokens = 0  # counters for metrics: tokens out,
        self.num_prompt_tokens = 0  # and prompt tokens in
        # Speculative decoding: a proposer drafts, the step verifies (engine/speculative.py).
        self.proposer = self._proposer(config.speculative_config)
        self.num_verifications = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.idle = False  # the last step ran nothing
        self.step_log = StepLog(config.step_log, config.block_size) if config.step_log else None

    def _proposer(self, spec: SpeculativeConfig | None):
        if spec is None:
            return None
        if spec.method == "ngram":
            return NgramProposer(spec, self.max_model_len)
        return DraftModelProposer(
            spec,
            self.model_config,
            self.block_manager,
            self.dtype,
            self.device,
            self.max_model_len,
            self.scheduler.watermark_blocks,
            self.runner.use_cpu_kernels,
            self.runner.linear_kernel,
        )

    # ---- requests in -------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Validates a prompt and returns its token ids."""
        return prompt_token_ids(self.tokenizer, prompt, self.model_config.vocab_size)

    def _check_length(self, num_tokens: int) -> None:
        check_prompt_length(num_tokens, self.max_model_len)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        output_token_ids: list[int] | None = None,
        num_emitted_chars: int | None = None,
    ) -> None:
        """Queues a request that generates here. Raises ValueError, naming what is wrong, and
        changes nothing else. output_token_ids: tokens it already generated elsewhere (a
        migration): recomputed with the prompt, as after a preemption; generation goes on after
        them, its text after the num_emitted_chars characters already streamed."""
        self._add(request_id, prompt, params, output_token_ids, num_emitted_chars)

    def _check_grammar(self, so: StructuredOutput, prior: list[int]) -> None:
        """Compiles the grammar (cached) and checks that the tokens generated elsewhere (a
        migration, a prefill node's first token) are in it. Raises ValueError naming structured_output."""
        matcher = self.runner.grammars.matcher(so)
        if prior and not matcher.consume_tokens(prior):
            raise ValueError("structured_output: output_token_ids are not in the grammar")

    def add_prefill(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        output_token_ids: list[int] | None = None,
        num_emitted_chars: int | None = None,
        kv_progress: LayerProgress | None = None,
    ) -> None:
        """The prefill side of a disaggregated request: computes the prompt's KV (and a migrated
        request's tokens) and samples the next token as add_request would, then hands off: its
        output ends with finish_reason None, the request going on elsewhere, or with the reason its
        own rule ended it at this token (stop, length). Either way the KV stays under a kv_lease
        until release_kv (export_kv or a transport reads it); kv_progress follows it as each
        layer is written (engine/kv_progress.py)."""
        self._add(
            request_id, prompt, params, output_token_ids, num_emitted_chars, prefill=True, kv_progress=kv_progress
        )

    def _add(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        output_token_ids: list[int] | None,
        num_emitted_chars: int | None,
        prefill: bool = False,
        kv_progress: LayerProgress | None = None,
    ) -> None:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if (request_id, 0) in self.requests or request_id in self.kv_leases or request_id in self.beams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        params.check_token_ids(self.model_config.vocab_size)
        ids = self.tokenize(prompt)
        prior = self.tokenize(list(output_token_ids)) if output_token_ids else []
        if params.structured_output is not None:
            self._check_grammar(params.structured_output, prior)
        self._check_length(len(ids) + len(prior))
        if len(prior) >= params.max_tokens:
            raise ValueError(f"output_token_ids: {len(prior)} tokens already reach max_tokens ({params.max_tokens})")
        if params.forks and (prefill or prior):
            raise ValueError(
                "n, best_of and beam_width must be 1 for a prefill to export or a migrated request: the "
                "samples fork where the request decodes"
            )
        if params.beam_width > 1:
            self._start_beam_search(request_id, ids, params)
            return
        seq = Sequence(request_id, ids, params, output_token_ids=prior, keep_kv=prefill, kv_progress=kv_progress)
        self.num_prompt_tokens += len(ids)
        self._track(seq, num_emitted_chars)
        if params.num_samples > 1:
            self.groups[request_id] = SampleGroup(params, live=params.num_samples)
        self.scheduler.add(seq)

    def _track(self, seq: Sequence, num_emitted_chars: int | None = None) -> None:
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, seq.params.stop, seq.params.min_tokens)
            for token_id in seq.output_token_ids:  # sampled elsewhere, and streamed there up to
                detok.add(token_id)  # num_emitted_chars characters
            emitted = len(detok.text) if num_emitted_chars is None else min(num_emitted_chars, len(detok.text))
            detok.num_emitted = emitted
        self.requests[seq.request_id, seq.index] = (seq, detok)

    def abort_request(self, request_id: str) -> bool:
        """Cancels a request and frees its blocks (and its kv_lease, if it already finished as a
        prefill). Returns whether it was still running."""
        group, beams = self.groups.pop(request_id, None), self.beams.pop(request_id, None)
        indexes = range(group.params.num_samples if group else 1)
        if beams is not None:
            indexes = [BEAM_INDEX + b for b in range(len(beams.search.running))]
        entries = [self.requests.pop((request_id, i), None) for i in indexes]
        if entries[0] is None:
            self.release_kv(request_id)
            return False
        for entry in entries:
            if entry is not None:
                self.scheduler.finish(entry[0], FinishReason.ABORT)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def load(self) -> dict[str, int]:
        """What a router or autoscaler looks at. Plain counters, safe to read from another thread
        at any time (a long step must not look like a dead node)."""
        return {
            "num_waiting": len(self.scheduler.waiting),
            "num_running": len(self.scheduler.running),
            "num_free_blocks": self.block_manager.num_free_blocks,
            "num_total_blocks": self.block_manager.num_blocks,
            "num_kv_leases": len(self.kv_leases),
            "block_size": self.config.block_size,
        }

    def counters(self) -> dict[str, int]:
        """Totals since the engine started, for metrics; safe to read from another thread."""
        return {
            "preemptions": self.scheduler.num_preemptions,
            "prompt_tokens": self.num_prompt_tokens,
            "generated_tokens": self.num_generated_tokens,
            "verifications": self.num_verifications,
            "draft_tokens": self.num_draft_tokens,
            "accepted_tokens": self.num_accepted_tokens,
        }

    def cache_changes(self, since: int) -> dict:
        """The prefix cache's names added and removed since a version (engine/block_manager.py);
        safe to call from another thread."""
        return self.block_manager.cache_changes(since)

    def prefix_cache_stats(self) -> dict[str, int]:
        bm = self.block_manager
        return {
            "query_tokens": bm.num_query_tokens,
            "hit_tokens": bm.num_hit_tokens,
            "cached_blocks": bm.num_cached_blocks,
            "evicted_blocks": bm.num_evicted_blocks,
        }

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        started, clock = time.time(), time.perf_counter()
        if self.proposer is not None:
            self.proposer.propose(self.scheduler.running)
        batch = self.scheduler.schedule()
        self.idle = not batch  # work waits (for blocks a transfer or lease holds): nothing ran
        if not batch:
            return []
        for seq, n in zip(batch.seqs, batch.num_scheduled_tokens):
            if seq.kv_progress is not None and seq.num_computed_tokens + n == seq.num_tokens:
                seq.kv_progress.scheduled(seq.block_table, seq.num_tokens)  # the last chunk: blocks fixed
        logged = None
        if self.step_log:
            t = time.perf_counter()
            logged = self.step_log.describe(batch)
            clock += time.perf_counter() - t  # the log's own cost is not the step's
        sampled = self.runner.execute(batch)
        for seq, tokens in zip(batch.seqs, sampled.token_ids):
            if seq.draft_token_ids:
                self._verified(seq, len(seq.draft_token_ids), len(tokens) - 1)
            if tokens and seq.index == 0 and seq.request_id in self.groups:
                self._fork(seq)  # its prompt's KV is computed now: the other samples share it
        self.scheduler.update(batch, sampled.token_ids)  # cuts the tokens past a stop
        outputs = []
        for seq, tokens, logprobs in zip(batch.seqs, sampled.token_ids, sampled.logprobs):
            if not tokens or (seq.request_id, seq.index) not in self.requests:
                continue
            out = self._postprocess(seq, tokens, logprobs)
            if seq.index >= BEAM_INDEX:
                outputs.extend(self._beam_step_done(out))
                continue
            group = self.groups.get(seq.request_id)
            if group is None:
                outputs.append(out)
                continue
            outputs.extend(group.emit(out))
            if not group.live:
                del self.groups[seq.request_id]
        if logged is not None:
            self.step_log.write(logged, started, time.perf_counter() - clock)
        return outputs

    def _start_beam_search(self, request_id: str, ids: list[int], params: SamplingParams) -> None:
        if not self.config.enable_prefix_caching:
            raise ValueError("beam search needs enable_prefix_caching: each step reuses the beams' cached KV")
        stops = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.scheduler.eos_token_ids)
        self.beams[request_id] = BeamRequest(request_id, ids, params, stops)
        self.num_prompt_tokens += len(ids)
        self._add_beam_steps(self.beams[request_id])

    def _add_beam_steps(self, beams: BeamRequest) -> None:
        for seq in beams.step_sequences():  # the prefix cache hands each its cached full blocks
            self.requests[seq.request_id, seq.index] = (seq, None)
            self.scheduler.add(seq)

    def _beam_step_done(self, out: RequestOutput) -> list[RequestOutput]:
        beams = self.beams.get(out.request_id)
        if beams is None or not beams.collect(out):
            return []
        if not beams.search.done:
            self._add_beam_steps(beams)
            return []
        del self.beams[out.request_id]
        outputs = beams.outputs(self._detokenize)
        self.num_generated_tokens += sum(len(o.token_ids) for o in outputs)
        return outputs

    def _detokenize(self, prompt_token_ids: list[int], token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, ())
        for i, token_id in enumerate(token_ids):
            detok.add(token_id, final=i == len(token_ids) - 1)
        return detok.text

    def _fork(self, parent: Sequence) -> None:
        group = self.groups[parent.request_id]
        if group.forked:
            return
        group.forked = True
        for child in reversed(
            fork(parent, group.params, self.block_manager, self.kv_cache, self.scheduler.watermark_blocks)
        ):
            self._track(child)
            self.scheduler.add(child, first=True)  # next step: their last prompt token

    def _verified(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        self.proposer.observe(seq, num_drafted, num_accepted)
        self.num_verifications += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted

    def _postprocess(self, seq: Sequence, tokens: list[int], logprobs: list) -> RequestOutput:
        detok = self.requests[seq.request_id, seq.index][1]
        new_text = ""
        for j, token_id in enumerate(tokens):
            if logprobs[j] is not None:
                seq.output_logprobs.append(logprobs[j])
                seq.cumulative_logprob += logprobs[j][token_id]
            if detok is None:
                continue
            # A prefill handed off ends here but its text goes on elsewhere: an incomplete
            # character is held back rather than flushed.
            last = j == len(tokens) - 1
            goes_on = seq.finish_reason is FinishReason.HANDOFF
            text, stopped = detok.add(token_id, final=last and seq.is_finished and not goes_on)
            new_text += text
            if stopped:
                if not seq.is_finished:
                    self._finish(seq, FinishReason.STOP)
                else:  # the last token allowed (max_tokens) held a stop string: it stopped (as vLLM)
                    seq.finish_reason = FinishReason.STOP
                if not last:  # accepted drafts after a stop string are not output
                    del seq.output_token_ids[j + 1 - len(tokens) :]
                    tokens = tokens[: j + 1]
                break
        self.num_generated_tokens += len(tokens)
        if seq.is_finished:
            del self.requests[seq.request_id, seq.index]
            if seq.keep_kv and seq.block_table:
                self.kv_leases[seq.request_id] = KVLease(seq.block_table, seq.num_computed_tokens)
                seq.block_table = []
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=list(seq.output_token_ids),
            text=detok.text if detok else "",
            new_token_ids=list(tokens),
            new_text=new_text,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason.value if seq.finish_reason not in (None, FinishReason.HANDOFF) else None,
            logprobs=list(seq.output_logprobs) if seq.params.logprobs is not None else None,
            num_preemptions=seq.num_preemptions,
            num_cached_tokens=seq.num_cached_tokens or 0,
            index=seq.index,
            cumulative_logprob=seq.cumulative_logprob if seq.output_logprobs else None,
        )

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self.scheduler.finish(seq, reason)

    # ---- KV out (prefill side) -----------------------------------------------------------
    def export_kv(self, request_id: str) -> torch.Tensor:
        """The leased KV of a finished keep_kv request: [layers, 2, tokens, kv_heads, head_dim]."""
        lease = self.kv_lease(request_id)
        return self.kv_cache.export_kv(lease.block_table, lease.num_tokens)

    def release_kv(self, request_id: str) -> None:
        """Ends a kv_lease; its blocks return to the free list once nothing else holds them."""
        lease = self.kv_leases.pop(request_id, None)
        if lease is not None:
            self.block_manager.decref(lease.block_table)

    def kv_lease(self, request_id: str) -> KVLease:
        if request_id not in self.kv_leases:
            raise KeyError(f"no kv_lease for request {request_id!r}")
        return self.kv_leases[request_id]

    # ---- KV in (decode side) -------------------------------------------------------------
    def try_reserve_kv(
        self, num_tokens: int, token_ids: list[int] | None = None, cache_salt: str = ""
    ) -> tuple[list[int], int] | None:
        """Blocks for num_tokens of KV computed elsewhere, and how many leading ones the prefix
        cache filled (with token_ids, the KV's tokens, its cached prefix is looked up); None while
        the pool cannot hold it. Fill them (kv_cache.import_kv or a transport), then
        add_prefilled_request, or give them back with free_kv."""
        if token_ids is not None and len(token_ids) == num_tokens:
            return self.reserve_kv_cached(token_ids, cache_salt)
        return (self.reserve_kv(num_tokens), 0) if self.can_reserve_kv(num_tokens) else None

    def can_reserve_kv(self, num_tokens: int) -> bool:
        return self.block_manager.blocks_for(num_tokens) <= self.block_manager.num_free_blocks

    def reserve_kv(self, num_tokens: int) -> list[int]:
        """Blocks for KV computed elsewhere (see try_reserve_kv)."""
        if num_tokens >= self.max_model_len:
            self._check_length(num_tokens)
        return self.block_manager.allocate_blocks(self.block_manager.blocks_for(num_tokens))

    def reserve_kv_cached(self, token_ids: list[int], cache_salt: str = "") -> tuple[list[int], int] | None:
        """reserve_kv for the KV of token_ids, whose longest cached prefix of full blocks is taken
        from the prefix cache (shared: never write them); returns (blocks, how many of them came
        from the cache), or None when the pool cannot hold the rest."""
        self._check_length(len(token_ids))
        probe = Sequence("", list(token_ids), SamplingParams(max_tokens=1, cache_salt=cache_salt))
        bm = self.block_manager
        cached = bm.acquire_prefix(probe)  # leaves the last token's block to fill
        need = bm.blocks_for(len(token_ids)) - len(probe.block_table)
        if need > bm.num_free_blocks:
            bm.free(probe)
            return None
        bm.record_lookup(len(token_ids), cached)
        return probe.block_table + bm.allocate_blocks(need), cached // self.config.block_size

    def free_kv(self, block_table: list[int]) -> None:
        self.block_manager.decref(block_table)

    def add_prefilled_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        params: SamplingParams,
        block_table: list[int],
        num_emitted_chars: int | None = None,
    ) -> None:
        """Admits a sequence whose prompt KV already sits in `block_table` (reserved with
        reserve_kv) and whose first tokens were sampled elsewhere; decoding continues from there.
        With no output_token_ids, the last prompt token is computed again here to sample the first
        (parallel sampling: every sample draws its own first token from the one imported KV).
        The sequence owns the blocks from now on, also if this raises."""
        seq = Sequence(
            request_id,
            list(prompt_token_ids),
            params,
            output_token_ids=list(output_token_ids),
            num_computed_tokens=len(prompt_token_ids) + len(output_token_ids) - 1,
            block_table=list(block_table),
        )
        try:
            if not isinstance(params, SamplingParams):
                raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
            if (request_id, 0) in self.requests or request_id in self.beams:
                raise ValueError(f"request_id {request_id!r} is already in use")
            if params.forks and output_token_ids:
                raise ValueError(
                    "output_token_ids must be empty with n, best_of or beam_width > 1: the samples "
                    "(beams) draw their first tokens here, from the imported KV"
                )
            if params.beam_width > 1 and not self.config.enable_prefix_caching:
                raise ValueError("beam search needs enable_prefix_caching: each step reuses the beams' cached KV")
            params.check_token_ids(self.model_config.vocab_size)
            self.tokenize(seq.prompt_token_ids + seq.output_token_ids)
            self._check_length(seq.num_computed_tokens)
            if params.structured_output is not None:  # the prefill node's token(s) in the grammar
                self._check_grammar(params.structured_output, seq.output_token_ids)
            if self.block_manager.blocks_for(seq.num_computed_tokens) > len(block_table):
                raise ValueError(
                    f"block_table has {len(block_table)} blocks, too few for {seq.num_computed_tokens} tokens"
                )
        except ValueError:
            self.block_manager.free(seq)
            raise
        self.block_manager.cache_computed_blocks(seq)  # its imported full blocks serve later prompts too
        if params.beam_width > 1:  # the beams find the imported full blocks in the prefix cache
            self.block_manager.free(seq)
            self._start_beam_search(request_id, seq.prompt_token_ids, params)
            return
        self.num_prompt_tokens += seq.num_prompt_tokens
        self._track(seq, num_emitted_chars)
        self.scheduler.add(seq)
        if params.num_samples > 1:  # the other samples share the imported prompt KV
            self.groups[request_id] = SampleGroup(params, live=params.num_samples)
            self._fork(seq)

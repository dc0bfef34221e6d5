"""Executes a ScheduledBatch: packs its tokens, runs one forward, samples. Knows nothing of
queues or requests beyond what the batch says."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch

from engine import cpu_kernels, cuda_kernels
from engine.attention import build_metadata
from engine.config import EngineConfig
from engine.hardware import ORDERED_LINEARS, can_prepack, cpu_features, cpu_vendor
from engine.kv_cache import KVCache
from engine.linear import CHUNK_ROWS, rows_invariant
from engine.model import LlamaModel
from engine.model_config import ModelConfig
from engine.ops import Ops
from engine.sampler import Sampler, SamplerOutput
from engine.scheduler import ScheduledBatch
from engine.speculative import first_rejected
from engine.structured_output import GrammarCompiler, apply_masks, fill_masks
from engine.weights import load_weights

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        cfg: ModelConfig,
        model_dir: Path,
        config: EngineConfig,
        dtype: torch.dtype,
        device: torch.device,
        max_model_len: int,
        kv_allocator: Callable[[int], torch.Tensor] | None = None,
    ):
        self.cfg = cfg
        self.device = device
        self.block_size = config.block_size
        # The C++ kernels (decode attention, fused elementwise ops) on CPUs where they build.
        self.use_cpu_kernels = config.cpu_kernels and device.type == "cpu" and cpu_kernels.load()
        # Decodes read the KV in place through the block table: the C++ kernel on a CPU, Triton's on
        # CUDA where it builds and agrees with torch on this GPU (else SDPA over gathered KV).
        self.decode_kernel = (self.use_cpu_kernels and cpu_kernels.decode_attention_fits(cfg.head_dim)) or (
            config.cuda_kernels
            and device.type == "cuda"
            and not cfg.attn_softcap  # (the Triton kernel has no soft cap)
            and self._cuda_kernel_runs(device, dtype, config)
        )
        # Prefill attention as chunked matmuls: faster than torch's flash kernel on a CPU in bf16.
        self.prefill_matmul = self.use_cpu_kernels and dtype == torch.bfloat16
        # Elsewhere on a CPU, one SDPA call a prefill sequence (up to attention.ALONE_MAX_SEQS of them).
        self.prefill_alone = device.type == "cpu"
        # Deterministic: every token a single query through the C++ kernel (its sums run over the
        # context in blocks of absolute positions), every linear summed in k order (engine/csrc/ordered_linear.cpp).
        self.deterministic = config.deterministic
        if self.deterministic and not (self.decode_kernel and self.use_cpu_kernels):
            raise ValueError(
                "deterministic: needs the C++ CPU attention kernel, which this engine does not run (device "
                f"{device.type}, cpu_kernels {config.cpu_kernels}, kernels built {self.use_cpu_kernels}, head_dim "
                f"{cfg.head_dim}); it runs with --device cpu, the CPU kernels on, head_dim a multiple of 16 up to 256"
            )
        self.linear_kernel = self._linear_kernel(config, dtype)
        self.quantization = config.quantization
        if self.quantization != "none" and not self.use_cpu_kernels:
            raise ValueError(
                f"quantization {self.quantization}: needs the C++ CPU kernels, which this engine does not run (device "
                f"{device.type}, cpu_kernels {config.cpu_kernels}, kernels built {self.use_cpu_kernels}); it runs "
                "with --device cpu, the CPU kernels on"
            )
        if self.quantization != "none":
            log.info(
                "linears: the decoder layers' %s weight-only, groups of 32 (pdserve's kernel), the LM head %s "
                "(or a GGUF file's own head blocks)",
                self.quantization,
                dtype,
            )
        weights = load_weights(model_dir, cfg, dtype, device, self.linear_kernel, self.quantization)
        if self.linear_kernel == "onednn_chunks":  # proven where tested; checked again on this CPU
            for linear in (weights.layers[0].qkv, weights.lm_head):
                if not rows_invariant(linear):
                    raise RuntimeError(
                        f"linear_kernel onednn_chunks: on this CPU (class {cpu_features().isa}) a row's bits moved "
                        "with the other rows of its chunk; run linear_kernel ordered"
                    )
        self.model = LlamaModel(cfg, weights, max_model_len, Ops(fused=self.use_cpu_kernels))
        self.numerics = self._numerics()
        bytes_per_block = cfg.kv_bytes_per_token(dtype.itemsize) * config.block_size
        num_blocks = config.num_kv_blocks or config.kv_cache_bytes // bytes_per_block
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_bytes must hold at least one block of {bytes_per_block} bytes, got {config.kv_cache_bytes}"
            )
        # kv: [layers, 2, blocks, block_size, kv_heads, head_dim]
        buffer = kv_allocator(num_blocks * bytes_per_block) if kv_allocator else None
        self.kv_cache = KVCache(
            cfg.num_layers, num_blocks, config.block_size, cfg.num_kv_heads, cfg.head_dim, dtype, device, buffer
        )
        self.sampler = Sampler(config.seed, device, cfg.eos_token_ids)
        self.grammars: GrammarCompiler | None = None  # structured output's (the engine sets it: it has the tokenizer)

    def _cuda_kernel_runs(self, device: torch.device, dtype: torch.dtype, config: EngineConfig) -> bool:
        why = cuda_kernels.why_not(
            device, dtype, self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim, config.block_size
        )
        if why:
            log.warning(
                "CUDA decodes attend through SDPA over gathered KV: the Triton paged kernel cannot run: %s", why
            )
        return why is None

    def _linear_kernel(self, config: EngineConfig, dtype: torch.dtype) -> str:
        """The linears' kernel (engine/linear.py). ordered (engine/csrc/ordered_linear.cpp) when asked,
        in deterministic mode but on AMX, and by default where it measured the faster kernel: this CPU
        class and dtype, the kernels built for the class's own flags (engine/hardware.py).
        onednn_chunks when asked, and in deterministic mode on AMX: oneDNN's AMX tiles, batch-invariant
        on fixed chunks of rows (the ordered kernel has no tile instructions)."""
        if config.linear_kernel == "ordered" and not self.use_cpu_kernels:
            raise ValueError(
                f"linear_kernel ordered: needs the C++ CPU kernels, which this engine does not run (device "
                f"{self.device.type}, cpu_kernels {config.cpu_kernels}, kernels built {self.use_cpu_kernels}); "
                f"it runs with --device cpu, the CPU kernels on"
            )
        cpu = cpu_features()
        chunks_run = self.device.type == "cpu" and can_prepack(dtype)
        if config.linear_kernel == "onednn_chunks" and not chunks_run:
            raise ValueError(
                f"linear_kernel onednn_chunks: needs oneDNN's prepacked {dtype} weights, which this engine cannot use "
                f"(device {self.device.type}, CPU class {cpu.isa})"
            )
        kernel = config.linear_kernel
        if kernel == "auto" and self.deterministic:
            kernel = "onednn_chunks" if cpu.isa == "amx" and chunks_run else "ordered"
        elif kernel == "auto":
            own_build = cpu_kernels.BUILT[:1] == [" ".join(cpu.kernel_flags) or "plain C++"]
            ordered = self.use_cpu_kernels and own_build and dtype in ORDERED_LINEARS.get(cpu.isa, ())
            kernel = "ordered" if ordered else "onednn"
        if self.device.type == "cpu":
            named = {"ordered": "the ordered kernel", "onednn_chunks": f"oneDNN, prepacked, {CHUNK_ROWS} rows a call"}
            log.info(
                "linears: %s (%s, CPU class %s, linear_kernel %s)",
                named.get(kernel, "oneDNN, prepacked" if can_prepack(dtype) else "F.linear"),
                dtype,
                cpu.isa,
                config.linear_kernel,
            )
        return kernel

    def _numerics(self) -> str:
        """What decides the bits of the KV and logits: "default", or in deterministic mode the
        kernels that compute them (KV moves only between engines of equal numerics)."""
        weights = "" if self.quantization == "none" else f"; {self.quantization} weights"
        if self.model.w.gguf_blocks:  # other codes than the bf16 copy quantized again
            weights += f" from GGUF {'/'.join(self.model.w.gguf_blocks)} blocks"
        if not self.deterministic:
            return "default" + weights
        kernels = f"kernels {cpu_kernels.SOURCE_DIGEST} built {cpu_kernels.BUILT[0]}"
        if self.linear_kernel == "onednn_chunks":  # oneDNN's blocking may follow its version and thread count
            linears = f"oneDNN linears {CHUNK_ROWS} rows a call, {torch.get_num_threads()} threads"
        else:
            linears = "ordered linears"
        kernels = f"{linears}, {kernels}"
        return f"deterministic ({cpu_features().isa}, {cpu_vendor()}; {kernels}{weights}; torch {torch.__version__})"

    def forward(self, batch: ScheduledBatch) -> tuple[list[int], list[int], torch.Tensor]:
        """One forward over the batch's tokens. Returns the batch indices of the sequences whose KV
        catches up with their tokens this step (prefill chunks before the end do not), how many
        logit rows each has (1, or 1 + its drafts: a verification), and those rows [R, V] in fp32."""
        # Decodes and verifications first, as single-token queries: a sequence verifying d drafts
        # is d + 1 queries over the same block table, each seeing the positions up to its own.
        one_query = [
            n == 1 or bool(seq.draft_token_ids) or self.deterministic
            for seq, n in zip(batch.seqs, batch.num_scheduled_tokens)
        ]
        order = sorted(range(len(batch)), key=lambda i: not one_query[i])
        input_ids: list[int] = []
        starts, lens, tables = [], [], []
        num_decode = 0
        for i in order:
            seq, n, start = batch.seqs[i], batch.num_scheduled_tokens[i], batch.seqs[i].num_computed_tokens
            input_ids.extend(seq.token_ids(start, start + n))
            if one_query[i]:
                starts.extend(range(start, start + n))
                lens.extend([1] * n)
                tables.extend([seq.block_table] * n)
                num_decode += n
            else:
                starts.append(start)
                lens.append(n)
                tables.append(seq.block_table)
        meta = build_metadata(
            starts,
            lens,
            tables,
            num_decode,
            self.block_size,
            self.cfg.sliding_window,
            self.device,
            self.decode_kernel,
            self.prefill_matmul,
            self.prefill_alone,
            self.cfg.local_window,
        )
        ids = torch.tensor(input_ids, dtype=torch.long).to(self.device)
        # Layer-wise streaming: prompts whose last chunk runs now publish each layer once written.
        streamed = [
            seq.kv_progress
            for seq, n in zip(batch.seqs, batch.num_scheduled_tokens)
            if seq.kv_progress is not None and seq.num_computed_tokens + n == seq.num_tokens
        ]
        hidden = self.model.forward(
            ids, meta.positions, meta, self.kv_cache, self._publisher(streamed) if streamed else None
        )  # [T, H]

        rows, counts, hidden_rows, pos = [], [], [], 0
        for i in order:
            seq, n = batch.seqs[i], batch.num_scheduled_tokens[i]
            pos += n
            if seq.num_computed_tokens + n >= seq.num_tokens:
                count = 1 + len(seq.draft_token_ids)
                rows.append(i)
                counts.append(count)
                hidden_rows.extend(range(pos - count, pos))
        if not rows:
            return [], [], hidden.new_empty(0, self.cfg.vocab_size, dtype=torch.float32)
        return rows, counts, self.model.compute_logits(hidden[torch.tensor(hidden_rows, device=self.device)])

    def _mask(self, batch: ScheduledBatch, rows: list[int], counts: list[int], logits: torch.Tensor) -> None:
        """Structured output: each constrained row's logits outside its grammar's next tokens to
        -inf (a verification's rows: the grammar after the drafts before them)."""
        constrained, grammar_rows, r = [], [], 0
        for i, count in zip(rows, counts):
            seq = batch.seqs[i]
            if seq.params.structured_output is not None:
                constrained += range(r, r + count)
                grammar_rows += [(seq, seq.draft_token_ids[:j]) for j in range(count)]
            r += count
        if constrained:
            apply_masks(logits, constrained, fill_masks(self.grammars, grammar_rows))

    def _publisher(self, streamed: list) -> Callable[[int], None]:
        cuda = self.device.type == "cuda"

        def layer_done(layer: int) -> None:
            event = None
            if cuda:
                event = torch.cuda.Event()
                event.record()
            for progress in streamed:
                progress.layer_done(layer, event)

        return layer_done

    def execute(self, batch: ScheduledBatch) -> SamplerOutput:
        """forward + sample. Per sequence in batch order: the tokens it emits (none for a prefill
        chunk short of the end; with drafts, those verified plus one) and their logprobs when asked.
        Each logit row is sampled as decoding without drafts would sample it (its own step, so
        its own seed), and drafts are kept while they equal what was sampled (engine/speculative.py)."""
        rows, counts, logits = self.forward(batch)
        result = SamplerOutput([[] for _ in batch.seqs], [[] for _ in batch.seqs])
        if not rows:
            return result
        if any(batch.seqs[i].params.structured_output is not None for i in rows):
            self._mask(batch, rows, counts, logits)
        params, steps = [], []
        for i, count in zip(rows, counts):
            seq = batch.seqs[i]
            params.extend([seq.params] * count)
            steps.extend(range(len(seq.output_token_ids), len(seq.output_token_ids) + count))

        def histories() -> tuple[list, list]:
            """Per row, its prompt and the output before its token (a verification's drafts too)."""
            prompts, pasts = [], []
            for i, count in zip(rows, counts):
                seq = batch.seqs[i]
                prompts += [seq.prompt_token_ids] * count
                pasts += [seq.output_token_ids + seq.draft_token_ids[:j] for j in range(count)]
            return prompts, pasts

        out = self.sampler(logits, params, steps, histories)
        r = 0
        for i, count in zip(rows, counts):
            emitted = first_rejected(batch.seqs[i].draft_token_ids, out.token_ids[r : r + count]) + 1
            result.token_ids[i] = out.token_ids[r : r + emitted]
            result.logprobs[i] = out.logprobs[r : r + emitted]
            r += count
        return result

"""Conditional disaggregation: where a request's prefill runs, on its decode node or in the prefill pool.

A chat follow-up whose history the decode node still caches needs only its new tokens computed.
Sending it through the prefill pool costs a queue there, two hops, and the transfer of the whole
KV; computing the suffix on the decode node costs a mixed step there, which also holds up every
sequence decoding on that node. The router measures the parts from the timings of the requests it
serves, and for each request picks the place that adds the least waiting, summed over this request
and the sequences decoding beside it:

    remote = prefill(tokens queued on the prefill node + its uncached tokens)
             + KV tokens to move x link time per token + hand-off (hops, admission)
    local  = local prefill(tokens queued in local prefills on the decode node + its uncached tokens)
             + sequences decoding there x its uncached tokens x local time per token

(a decode step is paid anyway: what a local prefill adds to the others' step is its tokens' share,
the line's slope.)

prefill(n) is a line (fixed + n x per token) fitted to recent prefills that ran alone on their
node (no other prefill of this router's in flight there, so the queue does not bias it), one line
for the prefill pool and one for local prefills on decode nodes; until a local prefill has been
measured, the prefill pool's line stands in (the same engine), and until local prefills of
sizes spanning a factor of two have been, its slope. Nothing is guessed: until a
remote prefill has been measured every prefill is remote. `max_local_tokens` bounds what a decode
node may compute (a long local prefill stalls every sequence decoding there), and
`max_local_tpot_s`, where set, bounds when it may: no local prefill starts while the sequences
decoding there get their tokens further apart than that (their recent time per output token, as
the router sees the node's streams: pool.TokenGaps). A local prefill lengthens every step it
shares with them, so set under a TPOT SLO the bound keeps prompts to the decode node's spare steps.

Late binding: where the choice is local but the decode node already computes a local prefill of
this router's, the new one would only queue behind it there. The decision says `hold`: the
router keeps the request and decides again when a prefill ends, on either side. If the prefill
node frees first, the prompt goes there; on the anchor workload a prompt bound to its decode node
on arrival waited there while the prefill node stood idle (docs/benchmarks.md at 0f5299a, section 5). This
is the router's share of what Dynamo's earlier global prefill queue did (prefill workers pulled
prompts when free).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

MODES = ("auto", "off", "always")
MAX_LOCAL_TOKENS = 1024  # measured on the anchor workload: docs/benchmarks.md at 0f5299a, section 5
SAMPLES = 32
# A free line needs sizes spanning this factor. On the anchor workload (590-630-token prompts) a
# local line through sizes that close came out at 1.38 s + 2.08 ms a token against the engine's
# 4.3 ms (docs/bench/placement_inputs_free_slope.log): it priced what a local prefill adds to each
# sequence decoding beside it at half.
SPAN = 2.0
EWMA = 0.2  # weight of a new sample in the link and hand-off averages


class LinearFit:
    """seconds = fixed + per_token x tokens, least squares over the last SAMPLES samples."""

    def __init__(self):
        self.samples: deque[tuple[int, float]] = deque(maxlen=SAMPLES)

    def add(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self.samples.append((tokens, seconds))

    def __bool__(self) -> bool:
        return bool(self.samples)

    def line(self, slope_prior: float | None = None) -> tuple[float, float]:
        """(fixed, per_token). Through sizes spanning SPAN or more, the least-squares line where
        its slope and fixed part come out >= 0, else proportional. Through sizes closer together
        (their noise would set a slope): with slope_prior (another node's slope) the fixed part
        that fits them, without, proportional."""
        sizes = [x for x, _ in self.samples]
        mean_x = sum(sizes) / len(sizes)
        mean_y = sum(y for _, y in self.samples) / len(sizes)
        if max(sizes) >= SPAN * min(sizes):  # (SPAN > 1: the sizes differ, var > 0)
            var = sum((x - mean_x) ** 2 for x in sizes)
            slope = sum((x - mean_x) * (y - mean_y) for x, y in self.samples) / var
            if slope > 0 and mean_y - slope * mean_x >= 0:
                return mean_y - slope * mean_x, slope
        elif slope_prior is not None:
            return max(0.0, mean_y - slope_prior * mean_x), slope_prior
        return 0.0, mean_y / mean_x

    def seconds(self, tokens: int, slope_prior: float | None = None) -> float:
        fixed, per_token = self.line(slope_prior)
        return fixed + per_token * tokens


@dataclass
class Decision:
    local: bool
    local_tokens: int  # tokens a local prefill would compute
    remote_tokens: int  # tokens a remote prefill would compute
    local_s: float | None = None  # the estimates it was made on (None: not measured yet)
    remote_s: float | None = None
    hold: bool = False  # local, behind another local prefill: decide again when a prefill ends
    decode_tpot_s: float | None = None  # with a TPOT bound and sequences decoding there: their recent TPOT


@dataclass
class Placement:
    mode: str = "auto"
    max_local_tokens: int = MAX_LOCAL_TOKENS
    remote: LinearFit = field(default_factory=LinearFit)
    local: LinearFit = field(default_factory=LinearFit)
    link_s_per_token: float | None = None
    handoff_s: float | None = None
    late_binding: bool = True
    max_local_tpot_s: float | None = None

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"local prefill mode must be one of {MODES}, got {self.mode!r}")
        if self.max_local_tokens < 0:
            raise ValueError(f"max_local_prefill_tokens must be >= 0, got {self.max_local_tokens}")
        if self.max_local_tpot_s is not None and not (0 < self.max_local_tpot_s < math.inf):
            raise ValueError(f"max_local_prefill_tpot must be > 0 seconds and finite, got {self.max_local_tpot_s}")

    def decide(
        self,
        num_tokens: int,
        decode_cached: int,
        prefill_cached: int,
        moved: int,
        prefill_queued: int = 0,
        local_queued: int = 0,
        decode_running: int = 0,
        prefill_node: bool = True,
        decode_tpot_s: float | None = None,
    ) -> Decision:
        """num_tokens: the prompt (with a migrated request's tokens); *_cached: its leading tokens
        each side's cache holds; moved: tokens of KV a remote prefill would send the decode node;
        *_queued: uncached tokens of this router's prefills in flight on each node;
        decode_running: sequences this router has decoding on the decode node; prefill_node:
        whether a healthy prefill node would take it (without one, local unless mode is off);
        decode_tpot_s: the decode node's recent time per output token (None: none measured)."""
        local_n = num_tokens - decode_cached
        remote_n = num_tokens - prefill_cached
        d = Decision(False, local_n, remote_n)
        if self.mode != "auto" or not prefill_node:
            d.local = self.mode != "off"  # always, or auto with no prefill node to take it
            return d
        if local_n > self.max_local_tokens:
            return d
        if self.max_local_tpot_s is not None and decode_running and decode_tpot_s is not None:
            d.decode_tpot_s = decode_tpot_s
            if decode_tpot_s > self.max_local_tpot_s:
                return d  # the sequences decoding there are already over the bound
        if not self.remote:
            return d  # nothing measured yet: the prefill pool's way, which measures it
        d.remote_s = (
            self.remote.seconds(prefill_queued + remote_n)
            + moved * (self.link_s_per_token or 0.0)
            + (self.handoff_s or 0.0)
        )
        fixed, per_token = self.local.line(self.remote.line()[1]) if self.local else self.remote.line()
        d.local_s = fixed + per_token * (local_queued + local_n) + decode_running * per_token * local_n
        d.local = d.local_s <= d.remote_s
        d.hold = self.late_binding and d.local and local_queued > 0
        return d

    # ---- what the router measured ------------------------------------------------------
    def measured_remote(
        self, computed: int, prefill_s: float, transfer_s: float, moved: int, handoff_s: float, alone: bool
    ) -> None:
        """computed: tokens the prefill node computed in prefill_s; moved: tokens of KV the decode
        node read in transfer_s; handoff_s: the rest of the way to the decode batch."""
        if alone:
            self.remote.add(computed, prefill_s)
        if moved > 0 and transfer_s > 0:
            self.link_s_per_token = _ewma(self.link_s_per_token, transfer_s / moved)
        self.handoff_s = _ewma(self.handoff_s, max(0.0, handoff_s))

    def measured_local(self, computed: int, prefill_s: float, alone: bool) -> None:
        if alone:
            self.local.add(computed, prefill_s)


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else (1 - EWMA) * old + EWMA * new

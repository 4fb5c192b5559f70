"""Sampler: one batched sampling step over the logits of B requests.

Order (as vLLM): penalties on the raw logits, then the per-request logit processors (logit_bias added, tokens
outside allowed_token_ids (all but the token a forced BOS / EOS names, where one applies) and those banned by
min_tokens or bad_words set to -inf), then the grammar bitmask of the rows with structured outputs (each request's
matcher fills its row of one [R, V/32] int32 mask; one kernel launch applies them all: kernels/token_bitmask.py),
then one fused sampling kernel (infer.kernels.sampling): greedy rows take the argmax; the others are scaled by their
temperature, filtered by top-k, top-p and min-p and drawn by an exponential race, per-row parameters in one launch,
no host sync.

Reproducibility: a row's noise is a hash of (seed, offset). The seed is `params.seed` (the engine gives every
sampled request one, from `draw_seed`), or for a row without one, a seed the sampler draws for the request from
its own generator (seeded by `Sampler(seed=...)`) and keeps until `release`; the offset is the number of tokens
the request has generated. So a request's tokens do not depend on what else is in the batch, nor on preemption
(the count survives a recompute), and a request resumed on another engine with its seed and delivered tokens
continues the same stream.

Logprobs are those of the raw logits (before penalties and temperature: vLLM's default).

Spoiled rows: a row whose logits after the penalties hold NaN or +inf (or are all -inf) cannot be sampled
honestly. `SamplerOutput.bad_rows` names them and the engine fails their requests ("internal"); they are
sampled as zeros meanwhile, so the kernel sees finite input and the rest of the batch is unaffected. The
check reads each row's maximum (NaN propagates through it): greedy rows get it from the same pass as their
argmax, the others from one max pass; one host read per step.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from infer.kernels.dispatch import Kernels, kernels_for
from infer.kernels.sampling import GREEDY_TEMPERATURE
from infer.worker.engine.request import Request


@dataclass(frozen=True)
class Penalties:
    """What the penalties of B rows need. Token ids are padded with V (a bin that is dropped)."""

    presence: torch.Tensor  # [B] float32
    frequency: torch.Tensor  # [B] float32
    repetition: torch.Tensor  # [B] float32
    prompt_token_ids: torch.Tensor | None  # [B, Lp] int64; None when no row has a repetition penalty
    output_token_ids: torch.Tensor  # [B, Lo] int64

    @classmethod
    def build(cls, requests: Sequence[Request], vocab_size: int, device: torch.device | str) -> Penalties:
        params = [r.params for r in requests]
        repetition = [p.repetition_penalty for p in params]
        return cls(
            presence=torch.tensor([p.presence_penalty for p in params], dtype=torch.float32, device=device),
            frequency=torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32, device=device),
            repetition=torch.tensor(repetition, dtype=torch.float32, device=device),
            prompt_token_ids=(
                _padded([r.prompt_token_ids for r in requests], vocab_size, device)
                if any(r != 1.0 for r in repetition)
                else None
            ),
            output_token_ids=_padded([r.output_token_ids for r in requests], vocab_size, device),
        )


@dataclass(frozen=True)
class SamplingMetadata:
    """The per-row sampling state of one step, built once by `build`. B rows, vocabulary V.

    Greedy rows hold neutral filters and seed 0 (the kernel reads neither for them). Optional fields are None
    when no row needs them, which lets the common cases skip the work.
    """

    vocab_size: int
    temperature: torch.Tensor  # [B] float32; < GREEDY_TEMPERATURE on greedy rows
    top_k: torch.Tensor  # [B] int64; 0 where disabled
    top_p: torch.Tensor  # [B] float32; 1.0 where disabled
    min_p: torch.Tensor  # [B] float32; 0.0 where disabled
    offsets: torch.Tensor  # [B] int64: tokens generated so far (the place in the noise)
    request_ids: tuple[str, ...]
    seeds: tuple[int | None, ...]  # params.seed; None on a sampled row that has none
    num_random_rows: int
    penalties: Penalties | None  # None: no row has a penalty
    banned: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) forced to -inf: min_tokens, bad_words
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (rows, token ids, float32 biases)
    allowed: tuple[torch.Tensor, torch.Tensor] | None  # (rows [R], [R, V] bool: may be sampled)
    grammar: tuple[torch.Tensor, torch.Tensor] | None  # (rows [R] int64, [R, ceil(V/32)] int32 bitmask)
    num_logprobs: tuple[int | None, ...]  # Request.num_logprobs of each row (params.logprobs)
    max_num_logprobs: int | None  # None: no row wants logprobs
    logprob_rows: torch.Tensor | None  # [R] int64 rows wanting logprobs; None when all do

    @property
    def num_rows(self) -> int:
        return len(self.num_logprobs)

    @property
    def all_greedy(self) -> bool:
        return self.num_random_rows == 0

    @property
    def all_random(self) -> bool:
        return self.num_random_rows == self.num_rows

    @property
    def no_penalties(self) -> bool:
        return self.penalties is None

    @property
    def fast_greedy(self) -> bool:
        """All greedy with nothing to adjust or report: the step is `logits.argmax(-1)`."""
        return self.all_greedy and self.no_penalties and not self.has_processors and self.max_num_logprobs is None

    @property
    def has_processors(self) -> bool:
        return (
            self.banned is not None
            or self.logit_bias is not None
            or self.allowed is not None
            or self.grammar is not None
        )

    @classmethod
    def build(
        cls, requests: Sequence[Request], vocab_size: int, device: torch.device | str = "cpu"
    ) -> SamplingMetadata:
        if not requests:
            raise ValueError("SamplingMetadata needs at least one request")
        params = [r.params for r in requests]
        greedy = [p.temperature < GREEDY_TEMPERATURE for p in params]

        def floats(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        def ints(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        num_logprobs = tuple(r.num_logprobs for r in requests)  # params.logprobs, or a beam's candidates
        forced = [r.forced_token() for r in requests]  # each row's forced BOS / EOS (worker/engine/request.py)
        logprob_rows = [i for i, n in enumerate(num_logprobs) if n is not None]
        return cls(
            vocab_size=vocab_size,
            temperature=floats([p.temperature for p in params]),
            top_k=ints([0 if g else max(p.top_k, 0) for p, g in zip(params, greedy)]),
            top_p=floats([1.0 if g else p.top_p for p, g in zip(params, greedy)]),
            min_p=floats([0.0 if g else p.min_p for p, g in zip(params, greedy)]),
            offsets=ints([r.num_output_tokens for r in requests]),
            request_ids=tuple(r.request_id for r in requests),
            seeds=tuple(0 if g else p.seed for p, g in zip(params, greedy)),
            num_random_rows=greedy.count(False),
            penalties=(
                Penalties.build(requests, vocab_size, device) if any(p.needs_penalties for p in params) else None
            ),
            banned=_banned_tokens(requests, forced, vocab_size, device),
            logit_bias=_logit_bias(requests, device),
            allowed=_allowed_tokens(requests, forced, vocab_size, device),
            grammar=_grammar_bitmask(requests, vocab_size, device),
            num_logprobs=num_logprobs,
            max_num_logprobs=max((n for n in num_logprobs if n is not None), default=None),
            logprob_rows=(ints(logprob_rows) if 0 < len(logprob_rows) < len(requests) else None),
        )


def _padded(rows: list[list[int]], pad: int, device: torch.device | str) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.int64, device=device).reshape(
        len(rows), width
    )


def _banned_tokens(
    requests: Sequence[Request], forced: Sequence[int | None], vocab_size: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows, token ids) to mask: while a request is under min_tokens its stop token ids always and its EOS
    ids unless ignore_eos; the last token of each bad word whose other tokens end the output; the generation
    config's suppressed tokens (and its begin-suppressed ones at the first generated token)."""
    rows: list[int] = []
    ids: list[int] = []
    for i, r in enumerate(requests):
        if forced[i] is not None:  # one token is allowed: nothing else to ban (_allowed_tokens)
            continue
        p = r.params
        banned = _bad_word_bans(r) | set(r.suppress_token_ids)
        if r.num_output_tokens == 0:
            banned |= set(r.begin_suppress_token_ids)
        if r.num_output_tokens < p.min_tokens:
            banned |= set(p.stop_token_ids) | (set() if p.ignore_eos else set(r.eos_token_ids))
        for token_id in sorted(t for t in banned if t < vocab_size):
            rows.append(i)
            ids.append(token_id)
    if not rows:
        return None
    return (torch.tensor(rows, dtype=torch.int64, device=device), torch.tensor(ids, dtype=torch.int64, device=device))


def _bad_word_bans(request: Request) -> set[int]:
    if not request.bad_words_token_ids:
        return set()
    output = request.output_token_ids
    return {
        word[-1]
        for word in request.bad_words_token_ids
        if len(word) == 1 or output[len(output) - len(word) + 1 :] == word[:-1]
    }


def _logit_bias(
    requests: Sequence[Request], device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    rows = [i for i, r in enumerate(requests) for _ in r.params.logit_bias or ()]
    if not rows:
        return None
    pairs = [pair for r in requests for pair in r.params.logit_bias or ()]
    return (
        torch.tensor(rows, dtype=torch.int64, device=device),
        torch.tensor([t for t, _ in pairs], dtype=torch.int64, device=device),
        torch.tensor([b for _, b in pairs], dtype=torch.float32, device=device),
    )


def _allowed_tokens(
    requests: Sequence[Request], forced: Sequence[int | None], vocab_size: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor] | None:
    allowed: list[tuple[int, tuple[int, ...]]] = []
    for i, r in enumerate(requests):
        token = forced[i]  # the generation config's forced BOS / EOS: that token alone
        ids = (token,) if token is not None else r.params.allowed_token_ids
        if ids is not None:
            allowed.append((i, tuple(ids)))
    if not allowed:
        return None
    mask = torch.zeros(len(allowed), vocab_size, dtype=torch.bool)
    for k, (_, ids) in enumerate(allowed):
        mask[k, list(ids)] = True
    return torch.tensor([i for i, _ in allowed], dtype=torch.int64, device=device), mask.to(device)


def _grammar_bitmask(
    requests: Sequence[Request], vocab_size: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor] | None:
    grammars = [(i, g) for i, r in enumerate(requests) if (g := r.grammar) is not None]
    if not grammars:
        return None
    bitmask = torch.full((len(grammars), -(-vocab_size // 32)), -1, dtype=torch.int32)
    for k, (_, grammar) in enumerate(grammars):
        grammar.fill(bitmask, k)
    return torch.tensor([i for i, _ in grammars], dtype=torch.int64, device=device), bitmask.to(device)


def apply_processors(logits: torch.Tensor, meta: SamplingMetadata, kernels: Kernels) -> torch.Tensor:
    """[B, V] float32 logits with logit_bias added and disallowed or banned tokens at -inf (a new tensor); the
    grammar's bitmask by `kernels` (the device's table)."""
    if meta.logit_bias is not None:
        rows, ids, bias = meta.logit_bias
        logits = logits.index_put((rows, ids), bias, accumulate=True)
    if meta.allowed is not None:
        rows, mask = meta.allowed
        logits = logits.index_copy(0, rows, logits.index_select(0, rows).masked_fill(~mask, -math.inf))
    if meta.banned is not None:
        logits = logits.index_put(meta.banned, logits.new_tensor(-math.inf))
    if meta.grammar is not None:
        rows, bitmask = meta.grammar
        logits = (
            logits.clone() if meta.logit_bias is None and meta.allowed is None and meta.banned is None else logits
        )  # the steps above made a new tensor already
        kernels.apply_token_bitmask(logits, bitmask, rows)
    return logits


@dataclass(frozen=True)
class SamplerOutput:
    """Tensors of one step; the engine converts each with one `.tolist()`.

    With logprobs, n = max_num_logprobs over the batch; row i's top entries are `top_ids[i, :n_i]`
    (sorted by decreasing logprob) with n_i = its params.logprobs. Rows that asked for no logprobs hold
    id -1 and logprob NaN.
    """

    token_ids: torch.Tensor  # [B] int64
    sampled_logprobs: torch.Tensor | None = None  # [B] float32
    top_ids: torch.Tensor | None = None  # [B, n] int64
    top_logprobs: torch.Tensor | None = None  # [B, n] float32
    bad_rows: tuple[int, ...] = ()  # rows whose logits were not finite: their outputs mean nothing


class Sampler:
    """Samples one token per row. Keeps the seed it drew for each unseeded request until
    `release(request_id)`."""

    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.kernels = kernels_for(self.device)  # the device's sampling, bitmask and greedy row max
        self._generator = random.Random(seed)
        self._drawn_seeds: dict[str, int] = {}

    def draw_seed(self) -> int:
        """A new seed from this sampler's generator (the engine gives one to each unseeded sampled request)."""
        return self._generator.getrandbits(63)

    def release(self, request_id: str) -> None:
        """Forget the request's drawn seed (call when it finishes); unknown ids are ignored."""
        self._drawn_seeds.pop(request_id, None)

    def sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """logits: [B, V] float32, not modified."""
        if meta.fast_greedy:  # each row's max (the check) and its first index (the token)
            top, token_ids = self.kernels.row_max(logits)
            return SamplerOutput(token_ids=token_ids, bad_rows=_rows_not_finite(top))
        processed = logits.float()
        if meta.penalties is not None:
            processed = apply_penalties(processed, meta.penalties)
        bad_rows = non_finite_rows(processed)
        if bad_rows:
            processed = processed.index_fill(0, torch.tensor(bad_rows, device=processed.device), 0.0)
        if meta.has_processors:
            processed = apply_processors(processed, meta, self.kernels)
        if meta.all_greedy:
            token_ids = processed.argmax(dim=-1)
        else:
            token_ids = self.kernels.sample(
                processed, meta.temperature, meta.top_k, meta.top_p, meta.min_p, self._seeds(meta), meta.offsets
            )
        if meta.max_num_logprobs is None:
            return SamplerOutput(token_ids=token_ids, bad_rows=bad_rows)
        return dataclasses.replace(
            _with_logprobs(logits, token_ids, meta.logprob_rows, meta.max_num_logprobs), bad_rows=bad_rows
        )

    def _seeds(self, meta: SamplingMetadata) -> torch.Tensor:
        """[B] int64: params.seed, else the request's drawn seed (drawn on first use)."""
        seeds = [
            self._drawn_seed(request_id) if seed is None else seed
            for request_id, seed in zip(meta.request_ids, meta.seeds)
        ]
        return torch.tensor(seeds, dtype=torch.int64, device=self.device)

    def _drawn_seed(self, request_id: str) -> int:
        seed = self._drawn_seeds.get(request_id)
        if seed is None:
            seed = self._drawn_seeds[request_id] = self.draw_seed()
        return seed


PROMPT_LOGPROBS_ROWS = 256  # prompt positions per log-softmax: bounds the [rows, V] float32 temporaries


def record_prompt_logprobs(chunks: Sequence, logits_of_rows) -> None:
    """Append to each chunk's `request.prompt_logprobs` (where not None) the rows of the prompt positions this
    step computed: position p gives prompt token p + 1's logprob and the top params.prompt_logprobs.
    `logits_of_rows(start, stop)` gives the logits of rows start..stop-1 of the step's [T, H] hidden states,
    chunks flattened in order. Positions already recorded (a recompute after a preemption, a step retried one
    request at a time) are skipped, so each row is recorded once."""
    offset = 0
    for chunk in chunks:
        request = chunk.request
        rows = request.prompt_logprobs
        first, last = max(chunk.start, 0 if rows is None else len(rows)), min(chunk.end, request.num_prompt_tokens - 1)
        if rows is not None and first < last:
            for lo in range(first, last, PROMPT_LOGPROBS_ROWS):
                hi = min(last, lo + PROMPT_LOGPROBS_ROWS)
                logits = logits_of_rows(offset + lo - chunk.start, offset + hi - chunk.start).float()
                rows += _prompt_rows(
                    logits.log_softmax(dim=-1),
                    request.prompt_token_ids[lo + 1 : hi + 1],
                    request.params.prompt_logprobs,
                )
        offset += chunk.num_new_tokens


def _prompt_rows(logprobs: torch.Tensor, targets: list[int], n: int) -> list[dict[int, float]]:
    target = torch.tensor(targets, dtype=torch.int64, device=logprobs.device)
    picked = logprobs.gather(1, target.unsqueeze(1)).squeeze(1).tolist()
    top = logprobs.topk(n, dim=-1) if n else None
    rows = []
    for i, (token_id, lp) in enumerate(zip(targets, picked)):
        row = {} if top is None else dict(zip(top.indices[i].tolist(), top.values[i].tolist()))
        row[token_id] = lp
        rows.append(row)
    return rows


def non_finite_rows(logits: torch.Tensor) -> tuple[int, ...]:
    """Rows of [B, V] `logits` holding a NaN or +inf, or nothing above -inf (-inf entries alone are fine: masked
    tokens). One max pass (a NaN anywhere makes the row's max NaN); one host read."""
    return _rows_not_finite(logits.amax(dim=-1))


def _rows_not_finite(row_max: torch.Tensor) -> tuple[int, ...]:
    """The rows whose maximum is NaN, +inf or -inf (see `non_finite_rows`)."""
    bad = ~row_max.isfinite()
    if not bool(bad.any()):
        return ()
    return tuple(bad.nonzero().squeeze(1).tolist())


def apply_penalties(logits: torch.Tensor, penalties: Penalties) -> torch.Tensor:
    """A new [B, V] tensor (vLLM's formulas): the repetition penalty r divides positive logits and multiplies
    the others, for tokens seen in the prompt or the output; then
    logits -= presence * (output count > 0) + frequency * output count."""
    vocab_size = logits.shape[1]
    counts = _bin_counts(penalties.output_token_ids, vocab_size)
    if penalties.prompt_token_ids is not None:
        seen = (_bin_counts(penalties.prompt_token_ids, vocab_size) > 0) | (counts > 0)
        r = penalties.repetition.unsqueeze(1)
        logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
    return logits - penalties.frequency.unsqueeze(1) * counts - penalties.presence.unsqueeze(1) * (counts > 0).float()


def _bin_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, L] ids padded with vocab_size -> [B, V] float32 occurrence counts."""
    counts = torch.zeros(token_ids.shape[0], vocab_size + 1, dtype=torch.float32, device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=torch.float32))
    return counts[:, :vocab_size]


def _with_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, rows: torch.Tensor | None, n: int) -> SamplerOutput:
    """Log-softmax of the raw logits for `rows` (None: all): the sampled token's and the top n."""
    raw = logits if rows is None else logits.index_select(0, rows)
    ids = token_ids if rows is None else token_ids.index_select(0, rows)
    logprobs = raw.float().log_softmax(dim=-1)
    sampled = logprobs.gather(1, ids.unsqueeze(1)).squeeze(1)
    top_logprobs, top_ids = logprobs.topk(n, dim=-1)
    if rows is None:
        return SamplerOutput(token_ids, sampled, top_ids, top_logprobs)
    num_rows = logits.shape[0]
    return SamplerOutput(
        token_ids,
        sampled.new_full((num_rows,), math.nan).index_copy_(0, rows, sampled),
        top_ids.new_full((num_rows, n), -1).index_copy_(0, rows, top_ids),
        top_logprobs.new_full((num_rows, n), math.nan).index_copy_(0, rows, top_logprobs),
    )

"""Sampler: one batched sampling step over the logits of B requests.

Order (as vLLM): penalties on the raw logits, the min_tokens mask, then greedy rows take the argmax; the
other rows are divided by their temperature, filtered by top-k, top-p and min-p, softmaxed and sampled by
the exponential race: token = argmax(probs / E), E ~ Exp(1) per vocabulary entry. That picks token i with
probability probs[i], like torch.multinomial, with no host sync.

Reproducibility: a request with `params.seed` draws its row's noise from its own generator, advanced once
per sampled token, so its tokens do not depend on what else is in the batch. Unseeded rows share one
batched draw from the sampler's generator.

Logprobs are those of the raw logits (before penalties and temperature: vLLM's default).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from infer.worker.request import Request

# Below this temperature a row is sampled greedily (dividing by it would overflow float32), as in vLLM.
GREEDY_TEMPERATURE = 1e-5
_TINY = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class Penalties:
    """What the penalties of B rows need. Token ids are padded with V (a bin that is dropped)."""

    presence: torch.Tensor                 # [B] float32
    frequency: torch.Tensor                # [B] float32
    repetition: torch.Tensor               # [B] float32
    prompt_token_ids: torch.Tensor | None  # [B, Lp] int64; None when no row has a repetition penalty
    output_token_ids: torch.Tensor         # [B, Lo] int64

    @classmethod
    def build(cls, requests: Sequence[Request], vocab_size: int, device: torch.device | str) -> "Penalties":
        params = [r.params for r in requests]
        repetition = [p.repetition_penalty for p in params]
        return cls(
            presence=torch.tensor([p.presence_penalty for p in params], dtype=torch.float32, device=device),
            frequency=torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32, device=device),
            repetition=torch.tensor(repetition, dtype=torch.float32, device=device),
            prompt_token_ids=(_padded([r.prompt_token_ids for r in requests], vocab_size, device)
                              if any(r != 1.0 for r in repetition) else None),
            output_token_ids=_padded([r.output_token_ids for r in requests], vocab_size, device),
        )


@dataclass(frozen=True)
class SamplingMetadata:
    """The per-row sampling state of one step, built once by `build`. B rows, vocabulary V.

    Optional tensors are None when no row needs them, which lets the common cases skip the work.
    Greedy rows hold neutral values (temperature 1, no top-k/top-p/min-p) so that their filters never
    cost the batch a sort.
    """

    vocab_size: int
    greedy: torch.Tensor                       # [B] bool
    temperature: torch.Tensor                  # [B] float32; 1.0 on greedy rows
    all_greedy: bool
    all_random: bool
    num_random_rows: int
    top_k: torch.Tensor | None                 # [B] int64; V where disabled
    num_candidates: int                        # leading sorted logits the top-k/top-p filters read: the
                                               # largest top_k, or V when a top-p row has no top-k
    top_p: torch.Tensor | None                 # [B] float32; 1.0 where disabled
    min_p: torch.Tensor | None                 # [B] float32; 0.0 where disabled
    penalties: Penalties | None                # None: no row has a penalty
    min_tokens_mask: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) forced to -inf
    seeded_rows: tuple[tuple[int, str, int], ...]  # (row, request_id, seed) of the random seeded rows
    num_logprobs: tuple[int | None, ...]       # params.logprobs of each row
    max_num_logprobs: int | None               # None: no row wants logprobs
    logprob_rows: torch.Tensor | None          # [R] int64 rows wanting logprobs; None when all do

    @property
    def num_rows(self) -> int:
        return len(self.num_logprobs)

    @property
    def no_top_k(self) -> bool:
        return self.top_k is None

    @property
    def no_top_p(self) -> bool:
        return self.top_p is None

    @property
    def no_min_p(self) -> bool:
        return self.min_p is None

    @property
    def no_penalties(self) -> bool:
        return self.penalties is None

    @property
    def fast_greedy(self) -> bool:
        """All greedy with nothing to adjust or report: the step is `logits.argmax(-1)`."""
        return (self.all_greedy and self.no_penalties and self.min_tokens_mask is None
                and self.max_num_logprobs is None)

    @classmethod
    def build(cls, requests: Sequence[Request], vocab_size: int,
              device: torch.device | str = "cpu") -> "SamplingMetadata":
        if not requests:
            raise ValueError("SamplingMetadata needs at least one request")
        params = [r.params for r in requests]
        greedy = [p.temperature < GREEDY_TEMPERATURE for p in params]
        num_random = greedy.count(False)

        def floats(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        top_k = [vocab_size if g or not 0 < p.top_k < vocab_size else p.top_k for p, g in zip(params, greedy)]
        top_p = [1.0 if g else p.top_p for p, g in zip(params, greedy)]
        min_p = [0.0 if g else p.min_p for p, g in zip(params, greedy)]
        enabled_k = [k for k in top_k if k < vocab_size]
        top_p_without_k = any(p < 1.0 and k == vocab_size for k, p in zip(top_k, top_p))
        penalties = any(p.needs_penalties for p in params)
        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        seeded_rows = tuple((i, r.request_id, r.params.seed) for i, (r, g) in enumerate(zip(requests, greedy))
                            if not g and r.params.seed is not None)
        return cls(
            vocab_size=vocab_size,
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            temperature=floats([1.0 if g else p.temperature for p, g in zip(params, greedy)]),
            all_greedy=num_random == 0,
            all_random=num_random == len(requests),
            num_random_rows=num_random,
            top_k=torch.tensor(top_k, dtype=torch.int64, device=device) if enabled_k else None,
            num_candidates=vocab_size if top_p_without_k or not enabled_k else max(enabled_k),
            top_p=floats(top_p) if any(p < 1.0 for p in top_p) else None,
            min_p=floats(min_p) if any(p > 0.0 for p in min_p) else None,
            penalties=Penalties.build(requests, vocab_size, device) if penalties else None,
            min_tokens_mask=_min_tokens_mask(requests, vocab_size, device),
            seeded_rows=seeded_rows,
            num_logprobs=tuple(p.logprobs for p in params),
            max_num_logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=None),
            logprob_rows=(torch.tensor(logprob_rows, dtype=torch.int64, device=device)
                          if 0 < len(logprob_rows) < len(requests) else None),
        )


def _padded(rows: list[list[int]], pad: int, device: torch.device | str) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.int64,
                        device=device).reshape(len(rows), width)


def _min_tokens_mask(requests: Sequence[Request], vocab_size: int,
                     device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows, token ids) to mask while a request is under min_tokens: its stop token ids always, its EOS
    ids unless ignore_eos."""
    rows: list[int] = []
    ids: list[int] = []
    for i, r in enumerate(requests):
        p = r.params
        if r.num_output_tokens >= p.min_tokens:
            continue
        banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(r.eos_token_ids))
        for token_id in sorted(t for t in banned if t < vocab_size):
            rows.append(i)
            ids.append(token_id)
    if not rows:
        return None
    return (torch.tensor(rows, dtype=torch.int64, device=device),
            torch.tensor(ids, dtype=torch.int64, device=device))


@dataclass(frozen=True)
class SamplerOutput:
    """Tensors of one step; the engine converts each with one `.tolist()`.

    With logprobs, n = max_num_logprobs over the batch; row i's top entries are `top_ids[i, :n_i]`
    (sorted by decreasing logprob) with n_i = its params.logprobs. Rows that asked for no logprobs hold
    id -1 and logprob NaN.
    """

    token_ids: torch.Tensor                      # [B] int64
    sampled_logprobs: torch.Tensor | None = None  # [B] float32
    top_ids: torch.Tensor | None = None           # [B, n] int64
    top_logprobs: torch.Tensor | None = None      # [B, n] float32


class Sampler:
    """Samples one token per row. Keeps one generator per seeded request until `release(request_id)`."""

    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self._request_generators: dict[str, torch.Generator] = {}

    def release(self, request_id: str) -> None:
        """Forget the request's generator (call when it finishes); unknown ids are ignored."""
        self._request_generators.pop(request_id, None)

    def sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """logits: [B, V] float32, not modified."""
        if meta.fast_greedy:
            return SamplerOutput(token_ids=logits.argmax(dim=-1))
        processed = logits.float()
        if meta.penalties is not None:
            processed = apply_penalties(processed, meta.penalties)
        if meta.min_tokens_mask is not None:
            processed = processed.index_put(meta.min_tokens_mask, processed.new_tensor(-math.inf))
        token_ids = self._sample_tokens(processed, meta)
        if meta.max_num_logprobs is None:
            return SamplerOutput(token_ids=token_ids)
        return _with_logprobs(logits, token_ids, meta.logprob_rows, meta.max_num_logprobs)

    def _sample_tokens(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        if meta.all_greedy:
            return logits.argmax(dim=-1)
        sampled = self._sample_random(logits, meta)
        if meta.all_random:
            return sampled
        return torch.where(meta.greedy, logits.argmax(dim=-1), sampled)

    def _sample_random(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        scaled = logits / meta.temperature.unsqueeze(1)  # a fresh tensor: the filters below work in place
        apply_top_k_top_p(scaled, meta.top_k, meta.top_p, meta.num_candidates)
        if meta.min_p is not None:
            apply_min_p(scaled, meta.min_p)
        probs = scaled.softmax(dim=-1)
        return probs.div_(self._race_noise(probs, meta)).argmax(dim=-1)

    def _race_noise(self, probs: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Exp(1) noise, [B, V]: seeded rows from their own generator (one draw per token), the rest from
        one batched draw."""
        uniform = torch.empty_like(probs)
        if len(meta.seeded_rows) < meta.num_random_rows:
            uniform.uniform_(generator=self.generator)
        for row, request_id, seed in meta.seeded_rows:
            uniform[row].uniform_(generator=self._request_generator(request_id, seed, probs.device))
        # -log(U) ~ Exp(1), 5x faster on CPU than exponential_. E is kept finite and positive whatever the
        # generator's range ([0, 1) on CPU, (0, 1] on CUDA): E == inf on the only allowed token, or
        # E == 0 (0 / 0 = NaN) on a forbidden one, would let argmax pick a forbidden token.
        return uniform.clamp_min_(_TINY).log_().neg_().clamp_min_(_TINY)

    def _request_generator(self, request_id: str, seed: int, device: torch.device) -> torch.Generator:
        generator = self._request_generators.get(request_id)
        if generator is None:
            generator = torch.Generator(device=device)
            generator.manual_seed(seed)
            self._request_generators[request_id] = generator
        return generator


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
    return (logits - penalties.frequency.unsqueeze(1) * counts
            - penalties.presence.unsqueeze(1) * (counts > 0).float())


def _bin_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, L] ids padded with vocab_size -> [B, V] float32 occurrence counts."""
    counts = torch.zeros(token_ids.shape[0], vocab_size + 1, dtype=torch.float32, device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=torch.float32))
    return counts[:, :vocab_size]


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                      num_candidates: int) -> torch.Tensor:
    """Masks [B, V] logits in place to -inf below each row's top-k / top-p cut (ties at the cut stay).

    top_k: [B], V where disabled; top_p: [B], 1.0 where disabled. Both filters read only the leading
    `num_candidates` logits in descending order: topk(num_candidates), or one full sort when a top-p row
    has no top-k. Top-p keeps the tokens whose higher-ranked tokens hold less than p of the top-k
    renormalized mass (vLLM's rule).
    """
    if top_k is None and top_p is None:
        return logits
    vocab_size = logits.shape[1]
    if num_candidates >= vocab_size:
        candidates = logits.sort(dim=-1, descending=True).values
    else:
        candidates = logits.topk(num_candidates, dim=-1).values  # [B, K], descending
    keep = torch.ones_like(candidates, dtype=torch.bool)
    unfiltered = torch.ones(logits.shape[0], 1, dtype=torch.bool, device=logits.device)
    if top_k is not None:
        kth = candidates.gather(1, (top_k.clamp(max=candidates.shape[1]) - 1).unsqueeze(1))
        keep &= candidates >= kth
        unfiltered &= top_k.unsqueeze(1) >= vocab_size
    if top_p is not None:
        p = top_p.unsqueeze(1)
        probs = candidates.masked_fill(~keep, -math.inf).softmax(dim=-1)
        mass_above = probs.cumsum(dim=-1) - probs
        keep &= (mass_above < p) | (p >= 1.0)
        unfiltered &= p >= 1.0
    # keep is a prefix of the sorted candidates (never empty): its last value is the cut.
    cut = candidates.gather(1, keep.sum(dim=-1, keepdim=True) - 1).masked_fill_(unfiltered, -math.inf)
    return logits.masked_fill_(logits < cut, -math.inf)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Masks in place the tokens with prob < min_p * max prob, i.e. logit < max logit + log(min_p)."""
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)
    return logits.masked_fill_(logits < threshold, -math.inf)


def _with_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, rows: torch.Tensor | None,
                   n: int) -> SamplerOutput:
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

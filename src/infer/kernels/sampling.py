"""Sampling: one token per row under per-row temperature, top-k, top-p and min-p, in one launch, no host sync.

Semantics (the Triton kernel and the twin agree token for token, up to float rounding at a filter's edge):

- Greedy rows (temperature < GREEDY_TEMPERATURE) take the first argmax of the raw logits.
- Other rows work on the scaled logits s = logits * (1 / T). Each filter keeps a threshold set
  {s >= cut}, so ties at a cut stay: top-k (0 < k < V) cuts at the k-th largest s; top-p (p < 1) then keeps
  the values whose strictly higher tokens hold less than p of the softmax mass of the top-k set (vLLM's
  rule); min-p (> 0) cuts at max s + log(min_p). A row keeps {s >= max of its cuts}.
- The token is drawn by a two-level exponential race, exact for the kept distribution. The vocabulary is cut
  into groups of GROUP consecutive ids; a group wins with probability proportional to its kept mass
  (argmax of log mass + Gumbel noise), then a token of that group with probability proportional to its own
  (argmax of s + Gumbel noise). Only G + GROUP noise values are drawn per row, not V.
- Hostile input never raises and always gives a token id of the vocabulary: a cut search that finds no value
  (a row of NaN or inf, whose masses compare false) keeps at least the row's max. Such a row's token means
  nothing; the engine checks the logits and fails its request (worker/engine/sampler.py).
- The noise is a counter-based hash of (seed, offset, counter): a row key mixed from the seed and the
  offset, then mix32(key + counter * golden ratio) per token id or group, computed identically by both paths
  (uint32 in Triton, int64 masked to 32 bits in torch, multipliers < 2**31 so products fit in int64). A
  request that samples with its own seed and offset = tokens generated so far gets the same tokens whatever
  else is in the batch.

The Triton kernel (one program per row, looping over the vocabulary in chunks of GROUP) finds the cuts
without sorting: a search over the order-preserving integer keys of float32 that tests 16 thresholds per
pass over the row, so 8 passes cover all 2**32 keys, each for top-k (counts) and top-p (masses); exact,
since a cut is a token's value. The twin is the CPU hot path: topk candidates when every sampled row has a
top-k; otherwise one exp pass over the rows, plus for top-p rows without top-k a histogram of the mass by
distance from the max and a topk inside the one bin that holds the cut. Never a full sort.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from infer.kernels._triton import tl, triton

# Below this temperature a row is sampled greedily (dividing by it would overflow float32), as in vLLM.
GREEDY_TEMPERATURE = 1e-5
GROUP = 1024  # token ids per group of the race; also the Triton kernel's chunk

_M32 = 0xFFFFFFFF
_MUL1 = 0x21F0AAAD  # odd multipliers below 2**31: (32-bit value) * multiplier < 2**63
_MUL2 = 0x735A2D97
_WEYL = 0x61C88647  # 2**32 / golden ratio, odd: counter * _WEYL visits every uint32 once
_SEED_SALT = 0x2545F491
_GROUP_TAG = 0x80000000  # group g is hashed as g | 2**31, apart from every token id
_TINY = 2.0**-126  # the smallest normal float32: empty groups get log(_TINY), below any Gumbel reach
_NUM_PIVOTS = 16  # thresholds the kernel's cut searches test per pass over a row
_NUM_BINS = 1024  # the twin's top-p histogram: bins of 1/16 nat below the max
_BINS_PER_NAT = 16.0


# ---- the Triton kernel ------------------------------------------------------------------------------


@triton.jit
def _mix32(x):
    """A 32-bit bijective mixer (xorshift-multiply, lowbias32-like); x is uint32."""
    x = x ^ (x >> 16)
    x = x * 0x21F0AAAD
    x = x ^ (x >> 15)
    x = x * 0x735A2D97
    x = x ^ (x >> 15)
    return x


@triton.jit
def _row_key(seed, offset):
    """The row's noise key (uint32) from its int64 seed (all 64 bits) and offset (its low 32 bits)."""
    key = _mix32(seed.to(tl.uint32) ^ 0x2545F491 ^ ((seed >> 32).to(tl.uint32) * 0x21F0AAAD))
    return _mix32(key ^ offset.to(tl.uint32))


@triton.jit
def _gumbel(counter, key):
    """Gumbel(0, 1) noise of (key, counter), uint32 both: the SplitMix-style hash mix32(key + counter * golden
    ratio), then u = (23 of its bits + 0.5) / 2**23, strictly inside (0, 1)."""
    h = _mix32(key + counter * 0x61C88647)
    u = ((h >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07
    return -tl.log(-tl.log(u))


@triton.jit
def _order_key(value):
    """float32 -> int32 whose signed order is the float order (NaN aside)."""
    bits = value.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _from_order_key(key):
    bits = key ^ ((key >> 31) & 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _pivots(lo, hi, NUM_PIVOTS: tl.constexpr):
    """[NUM_PIVOTS] int64 order keys spread evenly over (lo, hi]; every key of (lo, hi) is among them once
    hi - lo <= NUM_PIVOTS + 1, so a search that keeps the bracket [lo, hi) ends."""
    j = tl.arange(0, NUM_PIVOTS).to(tl.int64) + 1
    return lo + ((hi - lo) * j + NUM_PIVOTS) // (NUM_PIVOTS + 1)


@triton.jit
def _narrow(lo, hi, pivots, enough):
    """The bracket after one pass: the highest pivot that still holds enough, the lowest that does not."""
    return (
        tl.maximum(lo, tl.max(tl.where(enough, pivots, lo), axis=0)),
        tl.minimum(hi, tl.min(tl.where(enough, hi, pivots), axis=0)),
    )


@triton.jit
def _top_k_cut(row_ptr, inv_t, s_max, k, vocab_size, GROUP: tl.constexpr, NUM_PIVOTS: tl.constexpr):
    """The k-th largest scaled logit: the largest v with #{s >= v} >= k. A search over order keys with
    NUM_PIVOTS counts per pass over the row (8 passes cover the 2**32 keys with 16)."""
    cols = tl.arange(0, GROUP)
    lo = _order_key(tl.full((), float("-inf"), tl.float32)).to(tl.int64)  # count(s >= -inf) = V >= k
    hi = _order_key(s_max).to(tl.int64) + 1  # count(s >= above max) = 0 < k
    while lo + 1 < hi:
        pivots = _pivots(lo, hi, NUM_PIVOTS)
        pivot_values = _from_order_key(pivots.to(tl.int32))
        counts = tl.zeros((NUM_PIVOTS,), tl.int32)
        for start in range(0, vocab_size, GROUP):
            valid = start + cols < vocab_size
            s = tl.load(row_ptr + start + cols, mask=valid, other=float("-inf")).to(tl.float32) * inv_t
            above = (s[None, :] >= pivot_values[:, None]) & valid[None, :]
            counts += tl.sum(above.to(tl.int32), axis=1)
        lo, hi = _narrow(lo, hi, pivots, counts >= k)
    return _from_order_key(lo.to(tl.int32))


@triton.jit
def _top_p_cut(row_ptr, inv_t, s_max, floor, p, vocab_size, GROUP: tl.constexpr, NUM_PIVOTS: tl.constexpr):
    """The largest v >= floor with mass(s >= v) >= p * mass(s >= floor), mass = sum of exp(s - s_max);
    the same search as `_top_k_cut`, on masses."""
    cols = tl.arange(0, GROUP)
    floor_mass = tl.zeros((), tl.float32)
    for start in range(0, vocab_size, GROUP):
        valid = start + cols < vocab_size
        s = tl.load(row_ptr + start + cols, mask=valid, other=float("-inf")).to(tl.float32) * inv_t
        floor_mass += tl.sum(tl.where(valid & (s >= floor), tl.exp(s - s_max), 0.0), axis=0)
    target = p * floor_mass
    lo = _order_key(floor).to(tl.int64)
    hi = _order_key(s_max).to(tl.int64) + 1
    while lo + 1 < hi:
        pivots = _pivots(lo, hi, NUM_PIVOTS)
        pivot_values = _from_order_key(pivots.to(tl.int32))
        masses = tl.zeros((NUM_PIVOTS,), tl.float32)
        for start in range(0, vocab_size, GROUP):
            valid = start + cols < vocab_size
            s = tl.load(row_ptr + start + cols, mask=valid, other=float("-inf")).to(tl.float32) * inv_t
            e = tl.where(valid, tl.exp(s - s_max), 0.0)
            masses += tl.sum(tl.where(s[None, :] >= pivot_values[:, None], e[None, :], 0.0), axis=1)
        lo, hi = _narrow(lo, hi, pivots, masses >= target)
    return _from_order_key(lo.to(tl.int32))


@triton.jit
def _race(row_ptr, inv_t, s_max, cut, key, vocab_size, GROUP: tl.constexpr):
    """The two-level exponential race over the kept tokens {s >= cut}: a group by its mass, then a token."""
    cols = tl.arange(0, GROUP)
    best_key = tl.full((), float("-inf"), tl.float32)
    best_group = tl.zeros((), tl.int32)
    for start in range(0, vocab_size, GROUP):
        valid = start + cols < vocab_size
        s = tl.load(row_ptr + start + cols, mask=valid, other=float("-inf")).to(tl.float32) * inv_t
        mass = tl.sum(tl.where(valid & (s >= cut), tl.exp(s - s_max), 0.0), axis=0)
        group = start // GROUP
        # an empty group scores log(2**-126) + at most 16.7: below any group holding the max (>= -2.9)
        group_key = tl.log(tl.maximum(mass, 1.1754943508222875e-38))
        group_key += _gumbel(group.to(tl.uint32) | 0x80000000, key)
        better = group_key > best_key
        best_group = tl.where(better, group, best_group)
        best_key = tl.where(better, group_key, best_key)
    ids = best_group * GROUP + cols
    valid = ids < vocab_size
    s = tl.load(row_ptr + ids, mask=valid, other=float("-inf")).to(tl.float32) * inv_t
    token_keys = tl.where(valid & (s >= cut), s + _gumbel(ids.to(tl.uint32), key), float("-inf"))
    _, col = tl.max(token_keys, axis=0, return_indices=True)
    # clamped: a spoiled row (NaN keys) may pick a padding column of the last group; never past the vocabulary
    return tl.minimum(best_group * GROUP + col, vocab_size - 1).to(tl.int64)


@triton.jit
def _sample_kernel(
    logits_ptr,
    stride_row,
    temperature_ptr,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    seeds_ptr,
    offsets_ptr,
    out_ptr,
    cutoffs_ptr,
    vocab_size,
    GREEDY_T: tl.constexpr,
    GROUP: tl.constexpr,
    NUM_PIVOTS: tl.constexpr,
    WRITE_CUTOFFS: tl.constexpr,
):
    # One program per row, looping over the vocabulary in chunks of GROUP.
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    cols = tl.arange(0, GROUP)
    x_max = tl.full((), float("-inf"), tl.float32)
    argmax = tl.zeros((), tl.int32)
    for start in range(0, vocab_size, GROUP):
        valid = start + cols < vocab_size
        x = tl.load(row_ptr + start + cols, mask=valid, other=float("-inf")).to(tl.float32)
        chunk_max, chunk_arg = tl.max(x, axis=0, return_indices=True)
        better = chunk_max > x_max  # strict: the first maximum wins, as torch.argmax
        argmax = tl.where(better, start + chunk_arg, argmax)
        x_max = tl.where(better, chunk_max, x_max)

    temperature = tl.load(temperature_ptr + row).to(tl.float32)
    if temperature < GREEDY_T:
        token = argmax.to(tl.int64)
        cut = x_max
    else:
        inv_t = tl.math.div_rn(tl.full((), 1.0, tl.float32), temperature)
        s_max = x_max * inv_t  # rounding is monotone: the max of the scaled row
        cut = tl.full((), float("-inf"), tl.float32)
        k = tl.load(top_k_ptr + row).to(tl.int64)
        if (k > 0) & (k < vocab_size):
            cut = _top_k_cut(row_ptr, inv_t, s_max, k, vocab_size, GROUP, NUM_PIVOTS)
        p = tl.load(top_p_ptr + row).to(tl.float32)
        if p < 1.0:
            cut = _top_p_cut(row_ptr, inv_t, s_max, cut, p, vocab_size, GROUP, NUM_PIVOTS)
        min_p = tl.load(min_p_ptr + row).to(tl.float32)
        if min_p > 0.0:
            cut = tl.maximum(cut, s_max + tl.log(min_p))
        key = _row_key(tl.load(seeds_ptr + row).to(tl.int64), tl.load(offsets_ptr + row).to(tl.int64))
        token = _race(row_ptr, inv_t, s_max, cut, key, vocab_size, GROUP)
    tl.store(out_ptr + row, token)
    if WRITE_CUTOFFS:
        tl.store(cutoffs_ptr + row, cut)


def sample_triton(
    logits: torch.Tensor,  # [B, V] float32 / float16 / bfloat16
    temperature: torch.Tensor,  # [B] float; < GREEDY_TEMPERATURE: greedy
    top_k: torch.Tensor,  # [B] int; <= 0 or >= V: off
    top_p: torch.Tensor,  # [B] float; >= 1: off
    min_p: torch.Tensor,  # [B] float; <= 0: off
    seeds: torch.Tensor,  # [B] int64
    offsets: torch.Tensor,  # [B] int64: the position in the seed's noise stream
    out: torch.Tensor | None = None,  # [B] int64, written in full
    cutoffs: torch.Tensor | None = None,  # [B] float32, written in full when given
) -> torch.Tensor:  # [B] int64 token ids (`out` when given)
    """Samples one token per row (module docstring). `cutoffs` receives each row's cut on the scaled
    logits (kept: logits / T >= cutoff; -inf: unfiltered); greedy rows get their max logit."""
    num_rows, vocab_size = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    if out is None:
        out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    _sample_kernel[(num_rows,)](
        logits,
        logits.stride(0),
        temperature,
        top_k,
        top_p,
        min_p,
        seeds,
        offsets,
        out,
        cutoffs if cutoffs is not None else out,
        vocab_size,
        GREEDY_T=GREEDY_TEMPERATURE,
        GROUP=GROUP,
        NUM_PIVOTS=_NUM_PIVOTS,
        WRITE_CUTOFFS=cutoffs is not None,
        num_warps=8,
    )  # the searches hold [NUM_PIVOTS, GROUP] tiles
    return out


# ---- the PyTorch twin -------------------------------------------------------------------------------


def sample_torch(
    logits: torch.Tensor,  # [B, V] float32 / float16 / bfloat16
    temperature: torch.Tensor,  # [B] float; < GREEDY_TEMPERATURE: greedy
    top_k: torch.Tensor,  # [B] int; <= 0 or >= V: off
    top_p: torch.Tensor,  # [B] float; >= 1: off
    min_p: torch.Tensor,  # [B] float; <= 0: off
    seeds: torch.Tensor,  # [B] int64
    offsets: torch.Tensor,  # [B] int64: the position in the seed's noise stream
    out: torch.Tensor | None = None,  # [B] int64, written in full
    cutoffs: torch.Tensor | None = None,  # [B] float32, written in full when given
) -> torch.Tensor:  # [B] int64 token ids (`out` when given)
    """The twin of `sample_triton`. Made for the CPU: it reads a few per-row flags on the host to pick the
    cheapest vectorized path (on CUDA that would be a sync; kernels/dispatch.py runs Triton there)."""
    num_rows = logits.shape[0]
    x = logits.float()
    rows = (temperature >= GREEDY_TEMPERATURE).nonzero().squeeze(1)
    if rows.numel() == num_rows:
        tokens, cut = _sample_rows(x, temperature, top_k, top_p, min_p, seeds, offsets)
    else:
        cut, tokens = x.max(dim=-1)  # greedy rows: the first maximum, and the max logit as their cutoff
        if rows.numel() > 0:

            def pick(t: torch.Tensor) -> torch.Tensor:
                return t.index_select(0, rows)

            sampled, sampled_cut = _sample_rows(
                pick(x), pick(temperature), pick(top_k), pick(top_p), pick(min_p), pick(seeds), pick(offsets)
            )
            tokens.index_copy_(0, rows, sampled)
            cut.index_copy_(0, rows, sampled_cut)
    if cutoffs is not None:
        cutoffs.copy_(cut)
    return tokens if out is None else out.copy_(tokens)


def _sample_rows(
    x: torch.Tensor,  # [R, V] float32 raw logits of sampled rows
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,  # [R] each
) -> tuple[torch.Tensor, torch.Tensor]:  # tokens [R] int64, cuts [R] float32
    vocab_size = x.shape[1]
    inv_t = 1.0 / temperature.float()
    k, top_p, min_p = top_k.long(), top_p.float(), min_p.float()
    has_k, has_p, has_m = (k > 0) & (k < vocab_size), top_p < 1.0, min_p > 0.0
    any_k, all_k, any_p, any_m = torch.stack((has_k.any(), has_k.all(), has_p.any(), has_m.any())).tolist()
    key = _row_keys(seeds, offsets)
    top_p_rows, min_p_rows = (top_p if any_p else None), (min_p if any_m else None)
    if not any_k:
        s_max = x.amax(dim=-1) * inv_t
        return _sample_full(x, inv_t, s_max, torch.full_like(s_max, -math.inf), top_p_rows, min_p_rows, None, key)
    most = int(k.masked_fill(~has_k, 0).max())
    raw, ids = x.topk(most + 1, dim=-1)
    top = _Candidates(values=raw * inv_t.unsqueeze(1), ids=ids)  # rounding is monotone: still in order
    s_max = top.values[:, 0]
    c_k = top.values.gather(1, (k.clamp(1, most) - 1).unsqueeze(1)).squeeze(1)
    cut = torch.where(has_k, c_k, -math.inf)
    # The candidates hold every kept token unless a row lacks top-k or a k-th value's ties run past them.
    if not all_k or not bool((top.values[:, most] < c_k).all()):
        return _sample_full(x, inv_t, s_max, cut, top_p_rows, min_p_rows, top, key)
    kept = top.mass(s_max, cut)
    if any_p:
        cut = torch.where(has_p, _top_p_cut_sorted(top.values, kept, cut, top_p * kept.sum(dim=-1)), cut)
    if any_m:
        cut = _with_min_p(cut, s_max, min_p, has_m)
    if any_p or any_m:
        kept.masked_fill_(top.values < cut.unsqueeze(1), 0.0)
    return _race_candidates(top, kept, cut, key, vocab_size), cut


@dataclass(frozen=True)
class _Candidates:
    """The K largest scaled logits of each row, descending, and their token ids."""

    values: torch.Tensor  # [R, K] float32
    ids: torch.Tensor  # [R, K] int64

    def mass(self, s_max: torch.Tensor, cut: torch.Tensor) -> torch.Tensor:
        """[R, K] exp(value - max) of the values >= cut, 0 elsewhere."""
        return (self.values - s_max.unsqueeze(1)).exp_().masked_fill_(self.values < cut.unsqueeze(1), 0.0)


def _sample_full(
    x: torch.Tensor,
    inv_t: torch.Tensor,  # [R, V] raw logits, [R] 1 / temperature
    s_max: torch.Tensor,
    cut: torch.Tensor,  # [R] max scaled logit, top-k cut (or -inf)
    top_p: torch.Tensor | None,  # [R]; None when no row has top-p
    min_p: torch.Tensor | None,  # [R]; None when no row has min-p
    top: _Candidates | None,  # the top-k candidates, when a row has top-k
    key: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Filters and races over whole rows: one exp pass; top-p from the candidates where a row has top-k,
    else from a histogram (`_top_p_cut_binned`)."""
    if top is None and top_p is None and min_p is None:  # temperature only: exp(s - max) straight from x
        e = torch.addcmul(-s_max.unsqueeze(1), x, inv_t.unsqueeze(1)).exp_()
        return _race_full(x, inv_t, e, cut, key), cut
    s = x * inv_t.unsqueeze(1)
    e = (s - s_max.unsqueeze(1)).exp_()
    if top_p is not None:
        cut = torch.where(top_p < 1.0, _top_p_cut_full(s, e, s_max, cut, top_p, top), cut)
    if min_p is not None:
        cut = _with_min_p(cut, s_max, min_p, min_p > 0.0)
    e.masked_fill_(s < cut.unsqueeze(1), 0.0)
    return _race_full(x, inv_t, e, cut, key), cut


def _top_p_cut_full(
    s: torch.Tensor,
    e: torch.Tensor,  # [R, V] scaled logits, exp(s - max)
    s_max: torch.Tensor,
    cut: torch.Tensor,
    top_p: torch.Tensor,  # [R]; cut: top-k or -inf
    top: _Candidates | None,
) -> torch.Tensor:  # [R] (meaningful where top_p < 1)
    """Top-p cuts over whole rows: from the candidates where a row has top-k (its mass from the row, ties of
    the k-th value included), from `_top_p_cut_binned` elsewhere."""
    with_k = cut > -math.inf
    without_k = ((top_p < 1.0) & ~with_k).nonzero().squeeze(1)
    c_p = torch.full_like(cut, -math.inf)
    if top is not None and bool(with_k.any()):
        mass = torch.where(s >= cut.unsqueeze(1), e, 0.0).sum(dim=-1)
        c_p = _top_p_cut_sorted(top.values, top.mass(s_max, cut), cut, top_p * mass)
    if without_k.numel() == s.shape[0]:
        return _top_p_cut_binned(s, e, s_max, top_p)
    if without_k.numel() > 0:
        picked = (t.index_select(0, without_k) for t in (s, e, s_max, top_p))
        c_p.index_copy_(0, without_k, _top_p_cut_binned(*picked))
    return c_p


def _with_min_p(
    cut: torch.Tensor,
    s_max: torch.Tensor,
    min_p: torch.Tensor,  # [R] each
    has_m: torch.Tensor,
) -> torch.Tensor:
    """cut raised to s_max + log(min_p) on the rows with min-p (prob >= min_p * max prob)."""
    return torch.where(has_m, torch.maximum(cut, s_max + min_p.log()), cut)


def _top_p_cut_sorted(
    values: torch.Tensor,  # [R, K] scaled logits, descending
    kept: torch.Tensor,  # [R, K] exp(values - max) where values >= floor, else 0
    floor: torch.Tensor,  # [R] the top-k cut (all tokens above it are in `values`)
    target: torch.Tensor,  # [R] p * the mass of {s >= floor}
) -> torch.Tensor:  # [R] the largest value v with mass(s >= v) >= target
    last = (values >= floor.unsqueeze(1)).sum(dim=-1) - 1
    first_enough = (kept.cumsum(dim=-1) < target.unsqueeze(1)).sum(dim=-1)
    # clamped at 0: a row whose comparisons all fail (NaN) keeps at least its first value, the max
    return values.gather(1, torch.minimum(first_enough, last).clamp_(min=0).unsqueeze(1)).squeeze(1)


def _top_p_cut_binned(
    s: torch.Tensor,
    e: torch.Tensor,  # [R, V] scaled logits, exp(s - max)
    s_max: torch.Tensor,
    top_p: torch.Tensor,  # [R]
) -> torch.Tensor:  # [R] the largest v with mass(s >= v) >= p * mass
    """Top-p over the whole row without a sort: the mass in bins of 1/16 nat below the max (bins are
    monotone in s, so the bins before the cut's hold exactly the tokens above it), then the exact cut
    from the sorted tokens of the one bin that holds it."""
    last_bin = _NUM_BINS - 1
    distance = (s_max.unsqueeze(1) - s).mul_(_BINS_PER_NAT)
    bins = torch.fmin(distance, distance.new_tensor(float(last_bin))).long()  # fmin maps NaN to the last bin
    mass = e.new_zeros(s.shape[0], _NUM_BINS).scatter_add_(1, bins, e)
    cumulative = mass.cumsum(dim=-1)
    target = top_p * cumulative[:, -1]
    cut_bin = (cumulative < target.unsqueeze(1)).sum(dim=-1).clamp_(max=last_bin).unsqueeze(1)
    above = (cumulative - mass).gather(1, cut_bin)  # the mass of the bins before it
    in_bin = bins == cut_bin
    count = in_bin.sum(dim=-1)
    tied = torch.where(in_bin, s, -math.inf).topk(max(1, int(count.max().item())), dim=-1).values
    reached = (tied - s_max.unsqueeze(1)).exp_().cumsum(dim=-1).add_(above)
    first_enough = (reached < target.unsqueeze(1)).sum(dim=-1)
    cut = tied.gather(1, torch.minimum(first_enough, count - 1).clamp_(min=0).unsqueeze(1)).squeeze(1)
    # An empty cut bin only happens on a spoiled row (NaN / inf masses): it keeps its max, never nothing.
    return torch.where(count > 0, cut, s_max)


def _race_candidates(
    top: _Candidates,
    kept: torch.Tensor,  # [R, K] exp(value - max) of the kept candidates, 0 elsewhere
    cut: torch.Tensor,  # [R]
    key: torch.Tensor,  # [R] int64 noise keys
    vocab_size: int,
) -> torch.Tensor:  # [R] int64
    """The race of `_race_full` when every kept token is a candidate: group masses by scatter."""
    groups = top.ids // GROUP
    num_groups = triton.cdiv(vocab_size, GROUP)
    mass = kept.new_zeros(kept.shape[0], num_groups).scatter_add_(1, groups, kept)
    group_counters = (torch.arange(num_groups, device=kept.device) | _GROUP_TAG).expand(kept.shape[0], -1)
    group_noise, noise = _gumbel_torch(torch.cat((group_counters, top.ids), dim=1), key).split(
        (num_groups, kept.shape[1]), dim=1
    )
    group = _race_groups(mass, group_noise)
    race = (top.values + noise).masked_fill_(
        (top.values < cut.unsqueeze(1)) | (groups != group.unsqueeze(1)), -math.inf
    )
    return top.ids.gather(1, race.argmax(dim=-1, keepdim=True)).squeeze(1)


def _race_full(
    x: torch.Tensor,  # [R, V] raw logits
    inv_t: torch.Tensor,  # [R] 1 / temperature
    kept: torch.Tensor,  # [R, V] exp(s - max) on kept tokens, 0 elsewhere
    cut: torch.Tensor,  # [R]
    key: torch.Tensor,  # [R] int64 noise keys
) -> torch.Tensor:  # [R] int64
    """A group by its kept mass, then a token of that group: G + GROUP noise values per row."""
    vocab_size = x.shape[1]
    mass = _group_sums(kept)
    group_counters = torch.arange(mass.shape[1], device=x.device) | _GROUP_TAG
    group = _race_groups(mass, _gumbel_torch(group_counters.expand(mass.shape), key))
    ids = group.unsqueeze(1) * GROUP + torch.arange(min(GROUP, vocab_size), device=x.device)
    valid = ids < vocab_size
    in_group = x.gather(1, ids.clamp(max=vocab_size - 1)) * inv_t.unsqueeze(1)  # s, the same rounding
    dropped = ~valid | (in_group < cut.unsqueeze(1))
    race = (in_group + _gumbel_torch(ids, key)).masked_fill_(dropped, -math.inf)
    return ids.gather(1, race.argmax(dim=-1, keepdim=True)).squeeze(1)


def _group_sums(kept: torch.Tensor) -> torch.Tensor:  # [R, V] -> [R, ceil(V / GROUP)]
    vocab_size = kept.shape[1]
    whole = vocab_size // GROUP * GROUP
    sums = [kept[:, :whole].unflatten(1, (-1, GROUP)).sum(dim=-1)] if whole else []
    if whole < vocab_size:
        sums.append(kept[:, whole:].sum(dim=-1, keepdim=True))
    return torch.cat(sums, dim=1) if len(sums) > 1 else sums[0]


def _race_groups(mass: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:  # [R, G] each -> [R] int64
    """The winning group: argmax of log(kept mass) + the group's Gumbel noise (counter g | 2**31)."""
    return (mass.clamp_min(_TINY).log_() + noise).argmax(dim=-1)


def _mix32_torch(x: torch.Tensor) -> torch.Tensor:
    """The kernel's `_mix32` on an int64 tensor of uint32 values (a new tensor)."""
    x = x ^ (x >> 16)
    x = (x * _MUL1) & _M32
    x = x ^ (x >> 15)
    x = (x * _MUL2) & _M32
    return x ^ (x >> 15)


def _row_keys(seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:  # [R] int64 each -> [R]
    """The kernel's `_row_key`."""
    seeds = seeds.long()
    key = _mix32_torch((seeds & _M32) ^ _SEED_SALT ^ (((seeds >> 32) & _M32) * _MUL1 & _M32))
    return _mix32_torch(key ^ (offsets.long() & _M32))


def _gumbel_torch(counters: torch.Tensor, key: torch.Tensor) -> torch.Tensor:  # [R, N] int64, [R] -> [R, N]
    """`_gumbel` of the kernel: the same bits, the same float ops. counters < 2**32 + 2**31, so
    counter * _WEYL + key < 2**63."""
    h = _mix32_torch((counters * _WEYL).add_(key.unsqueeze(1)).bitwise_and_(_M32))
    u = (h >> 9).float().add_(0.5).mul_(2.0**-23)
    return u.log_().neg_().log_().neg_()


__all__ = ["GREEDY_TEMPERATURE", "GROUP", "sample_torch", "sample_triton"]

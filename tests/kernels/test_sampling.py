"""Fused sampling: the Triton kernel against its twin token for token, the twin's kept sets against a float64
reference, its draws against the filtered distribution, and per-request reproducibility."""

from __future__ import annotations

import math
import zlib

import pytest
import torch
from kernel_checks import DEVICE, KERNEL_DTYPES, requires_triton

from infer.kernels.dispatch import kernels_for
from infer.kernels.sampling import GREEDY_TEMPERATURE, GROUP, sample_torch, sample_triton

sample = kernels_for(DEVICE).sample  # what the engine runs on DEVICE

# (temperature, top_k, top_p, min_p) of one row of each kind; top_k <= 0 or >= V, top_p >= 1, min_p <= 0: off.
ROW_KINDS: dict[str, tuple[float, int, float, float]] = {
    "greedy": (0.0, 0, 1.0, 0.0),
    "greedy_despite_filters": (GREEDY_TEMPERATURE / 2, 50, 0.5, 0.1),
    "plain": (1.0, 0, 1.0, 0.0),
    "top_k": (0.8, 40, 1.0, 0.0),
    "top_p": (1.1, 0, 0.7, 0.0),
    "top_k_top_p": (0.9, 60, 0.8, 0.0),
    "min_p": (1.0, 0, 1.0, 0.05),
    "all_filters": (0.7, 100, 0.9, 0.02),
    "top_k_1": (1.0, 1, 1.0, 0.0),
    "tiny_top_p": (1.0, 0, 1e-6, 0.0),
    "top_k_past_vocab": (1.2, 10**6, 1.0, 0.0),
    "min_p_1": (1.0, 0, 1.0, 1.0),
    "three_allowed": (1.0, 0, 1.0, 0.0),  # all but three logits are -inf (a min_tokens-style mask)
    "tied_greedy": (0.0, 0, 1.0, 0.0),  # the max appears twice: the first one wins
}


def _params(kinds: list[str]) -> dict[str, torch.Tensor]:
    rows = [ROW_KINDS[k] for k in kinds]

    def column(i: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([r[i] for r in rows], dtype=dtype, device=DEVICE)

    return {
        "temperature": column(0, torch.float32),
        "top_k": column(1, torch.int64),
        "top_p": column(2, torch.float32),
        "min_p": column(3, torch.float32),
    }


def _logits(kinds: list[str], vocab: int, g: torch.Generator, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[B, V] random logits (scale 3) as a view with a padded row stride; special rows per kind."""
    wide = torch.randn(len(kinds), vocab + 7, generator=g) * 3
    for i, kind in enumerate(kinds):
        if kind == "three_allowed":
            keep = wide[i, [5, vocab // 2, vocab - 1]].clone()
            wide[i] = -math.inf
            wide[i, [5, vocab // 2, vocab - 1]] = keep
        elif kind == "tied_greedy":
            wide[i, [vocab // 3, vocab - 2]] = wide[i].max() + 1.0
    return wide.to(dtype).to(DEVICE)[:, :vocab]


def _noise_args(num_rows: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        "seeds": torch.randint(0, 2**62, (num_rows,), generator=g).to(DEVICE),
        "offsets": torch.randint(0, 10**6, (num_rows,), generator=g).to(DEVICE),
    }


# Vocabularies that are not a multiple of GROUP: one partial group; four full groups and three tokens. Other
# dtypes only change the load: one vocabulary each.
TRITON_CASES = [(1000, torch.float32), (4099, torch.float32)] + [(1000, d) for d in KERNEL_DTYPES[1:]]


@requires_triton
@pytest.mark.parametrize(("vocab", "dtype"), TRITON_CASES, ids=[f"{v}-{d}" for v, d in TRITON_CASES])
def test_triton_matches_twin_token_for_token(vocab, dtype):
    """Every row kind in one launch, a padded row stride, outputs poisoned beforehand; tokens and cutoffs
    equal the twin's."""
    g = torch.Generator().manual_seed(vocab)
    kinds = list(ROW_KINDS)
    logits = _logits(kinds, vocab, g, dtype)
    args = (logits, *_params(kinds).values(), *_noise_args(len(kinds), g).values())
    results = {}
    for name, impl in (("twin", sample_torch), ("triton", sample_triton)):
        out = torch.full((len(kinds),), -7, dtype=torch.int64, device=DEVICE)
        cutoffs = torch.full((len(kinds),), math.nan, dtype=torch.float32, device=DEVICE)
        assert impl(*args, out=out, cutoffs=cutoffs) is out
        results[name] = (out.cpu(), cutoffs.cpu())
    (tokens, cutoffs), (triton_tokens, triton_cutoffs) = results["twin"], results["triton"]
    assert tokens.tolist() == triton_tokens.tolist()
    # top-k / top-p cuts are token values, the same bits; a min-p cut is max + log(min_p), and the log of
    # Triton (or NumPy in the interpreter) may differ from torch's in the last bit
    assert not triton_cutoffs.isnan().any()
    torch.testing.assert_close(triton_cutoffs, cutoffs, rtol=3e-7, atol=0)

    x = logits.float().cpu()
    by_kind = dict(zip(kinds, range(len(kinds))))
    for kind in ("greedy", "greedy_despite_filters", "tied_greedy", "top_k_1", "tiny_top_p", "min_p_1"):
        row = by_kind[kind]
        assert tokens[row] == x[row].argmax(), kind  # the first maximum
    assert tokens[by_kind["tied_greedy"]] == vocab // 3
    assert tokens[by_kind["three_allowed"]] in (5, vocab // 2, vocab - 1)
    for kind in ("plain", "three_allowed", "top_k_past_vocab"):
        assert cutoffs[by_kind[kind]] == -math.inf, kind  # nothing filtered
    temperature = _params(kinds)["temperature"].cpu()
    for row, kind in enumerate(kinds):
        if temperature[row] >= GREEDY_TEMPERATURE:
            scaled = x[row] * (1.0 / temperature[row])
            assert scaled[tokens[row]] >= cutoffs[row], kind  # the token is in the kept set


# ---- the kept set against float64 -------------------------------------------------------------------


def _kept_float64(scaled: torch.Tensor, top_k: int, top_p: float, min_p: float) -> tuple[torch.Tensor, bool]:
    """The kept set of one row of scaled logits [V] in float64 (ties at a cut stay): top-k, then top-p by
    vLLM's rule (keep a value whose strictly higher tokens hold < p of the top-k mass), then min-p. Also
    whether float32 rounding could decide it (a mass within 1e-5 of p, or a logit within 1e-5 of the
    min-p cut): such rows are skipped."""
    s = scaled.double()
    vocab = s.numel()
    keep = torch.ones(vocab, dtype=torch.bool)
    if 0 < top_k < vocab:
        keep &= s >= s.sort(descending=True).values[top_k - 1]
    ambiguous = False
    if top_p < 1.0:
        probs = s.masked_fill(~keep, -math.inf).softmax(dim=0)
        values, order = s.sort(descending=True)
        sorted_probs = probs[order]
        exclusive = sorted_probs.cumsum(0) - sorted_probs
        _, inverse, counts = torch.unique_consecutive(values, return_inverse=True, return_counts=True)
        above = torch.empty(vocab, dtype=torch.float64)
        above[order] = exclusive[(counts.cumsum(0) - counts)[inverse]]  # the mass strictly above each value
        keep &= above < top_p
        ambiguous |= bool(((above - top_p).abs() < 1e-5).any())
    if min_p > 0.0:
        threshold = s.max() + math.log(min_p)
        keep &= s >= threshold
        ambiguous |= bool(((s - threshold).abs() < 1e-5 * max(1.0, abs(float(threshold)))).any())
    return keep, ambiguous


def _random_filters(num_rows: int, g: torch.Generator, regime: str) -> dict[str, torch.Tensor]:
    u = torch.rand(4, num_rows, generator=g)
    temperature = 0.3 + 1.7 * u[0]
    top_k = torch.randint(1, 300, (num_rows,), generator=g)
    top_p = 0.05 + 0.94 * u[1]
    min_p = 0.3 * u[2]
    if regime == "all_top_k":  # the twin races over topk candidates
        top_p[::3], min_p[::2] = 1.0, 0.0
    elif regime == "top_p_only":  # the twin's histogram path
        top_k[:], min_p[:] = 0, 0.0
    else:  # mixed: some rows without any filter send all to the full-row path
        top_k[::4], top_p[::3], min_p[::2] = 0, 1.0, 0.0
        top_k[1::6], top_p[1::6], min_p[1::6] = 0, 1.0, 0.0
    return {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p}


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "tied"])
@pytest.mark.parametrize("regime", ["all_top_k", "top_p_only", "mixed"])
def test_twin_kept_set_matches_float64(regime, ties):
    """cutoffs define the kept set {logits / T >= cutoff}; it equals the float64 one on every row that float32
    rounding cannot decide (at most 2 of 48 are skipped). Tied logits (steps of 0.25) check that ties at
    a cut stay."""
    num_rows, vocab = 48, 3000
    g = torch.Generator().manual_seed(zlib.crc32(f"{regime}-{ties}".encode()))
    logits = torch.randn(num_rows, vocab, generator=g) * 3
    if ties:
        logits = (logits * 4).round() / 4
    params = _random_filters(num_rows, g, regime)
    cutoffs = torch.empty(num_rows)
    noise = [t.cpu() for t in _noise_args(num_rows, g).values()]  # the twin, on CPU tensors
    sample_torch(logits, *params.values(), *noise, cutoffs=cutoffs)
    scaled = logits * (1.0 / params["temperature"]).unsqueeze(1)
    skipped = 0
    for row in range(num_rows):
        expected, ambiguous = _kept_float64(
            scaled[row], int(params["top_k"][row]), float(params["top_p"][row]), float(params["min_p"][row])
        )
        if ambiguous:
            skipped += 1
            continue
        assert torch.equal(scaled[row] >= cutoffs[row], expected), f"row {row}"
    assert skipped <= 2


# ---- the distribution -------------------------------------------------------------------------------

# Ten likely tokens spread over both groups of an 1100-token vocabulary (the second one partial), the rest
# a low tail: (token id, probability before the tail).
HEAD = {3: 0.22, 500: 0.17, 1023: 0.13, 1024: 0.11, 1050: 0.09, 1099: 0.08, 17: 0.07, 777: 0.06, 1070: 0.04, 64: 0.03}


def _chi_square_bound(dof: int, z: float = 4.75) -> float:
    """Wilson-Hilferty upper quantile of chi-square(dof); z = 4.75: a false alarm ~1e-6 under the null."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


@pytest.mark.parametrize(
    "filters",
    [
        (0.8, 0, 1.0, 0.0),
        (1.0, 6, 1.0, 0.0),
        (1.0, 0, 0.75, 0.0),
        (1.0, 0, 1.0, 0.08),
        (1.3, 8, 0.9, 0.02),
    ],
    ids=["temperature", "top_k", "top_p", "min_p", "all"],
)
def test_twin_draws_the_filtered_distribution(filters):
    """10,000 draws of one row under seeds 0..9999: only kept tokens come out, with the frequencies of
    the renormalized kept distribution (chi-square below its 1 - 1e-6 quantile; seeds are fixed, so
    the outcome is deterministic)."""
    temperature, top_k, top_p, min_p = filters
    vocab, draws, chunk = 1100, 10000, 2500
    row = torch.full((vocab,), math.log(1e-5))  # tail: ~1.1% of the mass before filters
    for token, p in HEAD.items():
        row[token] = math.log(p)
    scaled = row * (1.0 / torch.tensor(temperature))
    kept, _ = _kept_float64(scaled, top_k, top_p, min_p)
    expected = scaled.double().masked_fill(~kept, -math.inf).softmax(dim=0)
    tokens = []
    for start in range(0, draws, chunk):

        def per_row(value: float, dtype: torch.dtype) -> torch.Tensor:
            return torch.full((chunk,), value, dtype=dtype)

        tokens.append(
            sample_torch(
                row.expand(chunk, vocab),
                per_row(temperature, torch.float32),
                per_row(top_k, torch.int64),
                per_row(top_p, torch.float32),
                per_row(min_p, torch.float32),
                torch.arange(start, start + chunk),
                torch.zeros(chunk, dtype=torch.int64),
            )
        )
    counts = torch.bincount(torch.cat(tokens), minlength=vocab).double()
    assert counts[~kept].sum() == 0
    big = expected * draws >= 5  # the cells of the test; the rest of the kept mass pooled into one
    observed = torch.cat((counts[big], counts[kept & ~big].sum().unsqueeze(0)))
    wanted = torch.cat((expected[big], expected[kept & ~big].sum().unsqueeze(0))) * draws
    if wanted[-1] < 5:
        observed, wanted = observed[:-1], wanted[:-1]
    chi2 = float(((observed - wanted) ** 2 / wanted).sum())
    assert chi2 < _chi_square_bound(observed.numel() - 1), (chi2, observed.numel())
    assert counts[:GROUP].sum() > 0 and counts[GROUP:].sum() > 0  # both groups are drawn from


# ---- reproducibility --------------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["all_filters", "top_p", "plain"])
def test_seeded_row_is_independent_of_the_batch(target):
    """A row's token is a function of its logits, parameters, seed and offset, whatever else the batch holds
    (on CPU that changes the twin's path: topk candidates, the histogram top-p, or the full row)."""
    vocab, steps = 2000, 12
    g = torch.Generator().manual_seed(11)
    companions = [["top_k"], ["plain", "greedy"], ["top_p", "top_k_top_p", "greedy"], ["min_p", "top_k_1"]]
    for offset in range(steps):
        logits = torch.randn(1, vocab, generator=g) * 3
        seed = 2**40 + 17
        alone = sample(
            logits.to(DEVICE),
            *_params([target]).values(),
            torch.tensor([seed], device=DEVICE),
            torch.tensor([offset], device=DEVICE),
        )
        for others in companions:
            kinds = others[:1] + [target] + others[1:]
            batch = torch.randn(len(kinds), vocab, generator=g) * 3
            batch[1] = logits[0]
            seeds = torch.randint(0, 2**62, (len(kinds),), generator=g)
            offsets = torch.randint(0, 100, (len(kinds),), generator=g)
            seeds[1], offsets[1] = seed, offset
            tokens = sample(batch.to(DEVICE), *_params(kinds).values(), seeds.to(DEVICE), offsets.to(DEVICE))
            assert tokens[1] == alone[0], (offset, others)


def test_noise_follows_seed_and_offset():
    """On a uniform row the token is the noise: it changes with the offset, with every part of the seed
    (high 32 bits included), and comes back for the same (seed, offset)."""
    vocab, steps = 1000, 64
    logits = torch.zeros(steps, vocab, device=DEVICE)
    params = _params(["plain"] * steps).values()

    def stream(seed: int) -> list[int]:
        seeds, offsets = torch.full((steps,), seed, device=DEVICE), torch.arange(steps, device=DEVICE)
        return sample(logits, *params, seeds, offsets).tolist()

    base = stream(12345)
    assert len(set(base)) > steps * 3 // 4
    assert stream(12345) == base
    assert stream(12345 + 2**32) != base and stream(12346) != base and stream(2**62 + 12345) != base


# ---- hostile rows: never raise, always a token id of the vocabulary ------------------------------------

HOSTILE_ROWS = {  # how one row's logits are spoiled
    "nan": lambda row: row.index_fill_(0, torch.tensor([3, 700]), math.nan),
    "all_nan": lambda row: row.fill_(math.nan),
    "plus_inf": lambda row: row.index_fill_(0, torch.tensor([11]), math.inf),
    "two_plus_inf": lambda row: row.index_fill_(0, torch.tensor([11, 900]), math.inf),
    "all_minus_inf": lambda row: row.fill_(-math.inf),
    "huge": lambda row: row.mul_(1e37),
    "tiny": lambda row: row.mul_(1e-42),
}
HOSTILE_FILTERS = [
    (1.0, 0, 0.5, 0.0),
    (1.0, 40, 0.5, 0.0),
    (1e30, 0, 0.9, 0.0),
    (1e-5, 0, 1e-30, 0.0),
    (0.7, 100, 0.9, 1e-40),
    (1.0, 0, 1.0, 1.0),
    (3e38, 2**31 - 1, 0.3, 0.99),
]


@pytest.mark.parametrize(
    "impl", [sample_torch, pytest.param(sample_triton, marks=requires_triton)], ids=["twin", "triton"]
)
@pytest.mark.parametrize("filters", HOSTILE_FILTERS, ids=str)
def test_spoiled_rows_never_raise_and_give_a_vocabulary_token(impl, filters):
    """NaN / inf / absurd logits beside healthy rows (the engine fails such a request, but the kernel must
    still answer for the whole batch): every row gets a token id in [0, V); a healthy finite row keeps at
    least its argmax, so its token is the argmax when top_p or min_p leaves only it."""
    vocab = 1000
    g = torch.Generator().manual_seed(5)
    x = torch.randn(len(HOSTILE_ROWS) + 1, vocab, generator=g) * 3
    for i, spoil in enumerate(HOSTILE_ROWS.values()):
        spoil(x[i])
    rows = x.shape[0]
    t, k, p, m = filters

    def column(value, dtype):
        return torch.full((rows,), value, dtype=dtype, device=DEVICE)

    tokens = impl(
        x.to(DEVICE),
        column(t, torch.float32),
        column(k, torch.int64),
        column(p, torch.float32),
        column(m, torch.float32),
        *_noise_args(rows, g).values(),
    ).cpu()
    assert ((tokens >= 0) & (tokens < vocab)).all(), tokens.tolist()
    if m == 1.0 and t == 1.0:  # the healthy last row: only its max is within min_p of itself
        assert tokens[-1] == x[-1].argmax()

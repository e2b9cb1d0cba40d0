"""The D-cut selector (docs/method.md, "One D-cut step"), pinned down as properties of minidcut.dcut.

Confidences are drawn with many exact ties (runs of 1.0, a small pool of repeated values) and with a
limit vector that masks depths, because ties and masked depths are where a count-based keep_len could
go wrong. Every property is checked for a grid of rho that includes 0 and 1.
"""

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minidcut import dcut

RHOS = [0.0, 0.1, 0.25, 1 / 3, 0.5, 0.75, 0.9, 1.0]
SETTINGS = settings(max_examples=100, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def selector_inputs(draw):
    """(conf [B, D] in (0, 1], limit [B]) with plenty of exact ties. limit[i] is how many more
    drafts request i can use: 0 for an empty row, possibly more than D."""
    B, D = draw(st.integers(1, 8)), draw(st.integers(1, 15))
    free = st.floats(1e-6, 1.0, allow_nan=False, allow_infinity=False)
    pool = draw(st.lists(free, min_size=1, max_size=3))  # a few values, repeated across the batch
    value = draw(st.sampled_from(["ones", "pool", "free", "mixed"]))
    if value == "ones":
        cell = st.sampled_from([1.0, 1.0, 1.0, pool[0]])
    elif value == "pool":
        cell = st.sampled_from(pool + [1.0])
    elif value == "free":
        cell = free
    else:
        cell = st.one_of(st.just(1.0), st.sampled_from(pool), free)
    conf = torch.tensor(draw(st.lists(cell, min_size=B * D, max_size=B * D)),
                        dtype=torch.float32).view(B, D)
    if draw(st.booleans()):
        limit = torch.full((B,), D)
    else:
        limit = torch.tensor(draw(st.lists(st.integers(0, D + 3), min_size=B, max_size=B)))
    return conf, limit


def kept_mask(keep_len: torch.Tensor, D: int) -> torch.Tensor:
    """[B, D] bool: the prefix of length keep_len[i] of every row."""
    return torch.arange(D)[None, :] < keep_len[:, None]


def test_budget_is_round_rho_times_B_times_D():
    for B in range(1, 9):
        for D in range(1, 16):
            for rho in RHOS:
                K = dcut.budget(rho, B, D)
                assert K == round(rho * B * D) and 0 <= K <= B * D
            assert dcut.budget(0.0, B, D) == 0 and dcut.budget(1.0, B, D) == B * D


def test_prefix_scores_are_cumulative_log_confidences_and_minus_inf_past_the_limit():
    conf = torch.tensor([[0.5, 0.5, 1.0, 0.1], [1.0, 1.0, 1.0, 1.0], [0.9, 0.8, 0.7, 0.6]])
    log_s = dcut.prefix_scores(conf, torch.tensor([4, 2, 0]))
    expect = torch.log(conf).cumsum(1)
    assert torch.allclose(log_s[0], expect[0])
    assert torch.equal(log_s[1, :2], torch.zeros(2))  # confidence 1.0 is an exact score of 1
    assert torch.isneginf(log_s[1, 2:]).all() and torch.isneginf(log_s[2]).all()


@SETTINGS
@given(selector_inputs())
def test_keep_len_spends_min_K_finite_on_per_request_prefixes_that_form_a_global_top_K(inputs):
    conf, limit = inputs
    B, D = conf.shape
    log_s = dcut.prefix_scores(conf, limit)  # [B, D]
    assert (log_s[:, 1:] <= log_s[:, :-1]).all()  # non-increasing along depth: prefixes are well defined
    finite = int(torch.isfinite(log_s).sum())
    assert finite == int(limit.clamp(max=D).sum())
    Ks = [dcut.budget(r, B, D) for r in RHOS]
    keep = dcut.keep_lens(log_s, Ks)  # [n_rho, B]
    assert keep.shape == (len(RHOS), B) and not keep.is_floating_point()
    scores = log_s.double().exp()  # [B, D]; exp(-inf) = 0
    ranked = scores.flatten().sort(descending=True).values  # [B*D]
    for K, kl in zip(Ks, keep):
        assert int(kl.sum()) == min(K, finite)  # a -inf depth (never emitted) is never counted
        assert ((kl >= 0) & (kl <= limit.clamp(max=D))).all()
        kept = kept_mask(kl, D)  # [B, D]: the prefix each request sends to verification
        # Same total score as the true top K (equal up to swapping exactly tied scores).
        assert math.isclose(scores[kept].sum().item(), ranked[:K].sum().item(), rel_tol=1e-9, abs_tol=1e-12)
        # And exactly a top-K set: nothing left out scores above anything kept.
        if 0 < K < B * D and kept.any() and (~kept).any():
            assert log_s[kept].min() >= log_s[~kept].max()
        if K >= finite:  # every finite position is kept, and nothing else
            assert torch.equal(kl, limit.clamp(max=D))
    # A bigger budget keeps a superset: one global ranking serves every rho.
    assert (keep[1:] >= keep[:-1]).all()
    assert (keep[0] == 0).all()  # rho = 0: an AR step
    assert torch.equal(keep[-1], limit.clamp(max=D))  # rho = 1 keeps every depth that can be emitted


def test_keep_lens_never_counts_a_minus_inf_depth():
    """K larger than the finite positions: rows past their limit and empty rows keep nothing there."""
    log_s = torch.tensor([[-0.1, -0.2, -0.3, -0.4], [-0.05, -0.5, -math.inf, -math.inf], [-math.inf] * 4])
    assert dcut.keep_lens(log_s, [12])[0].tolist() == [4, 2, 0]
    assert dcut.keep_lens(log_s, [3, 6, 7])[:, :].sum(1).tolist() == [3, 6, 6]


def test_select_is_scores_then_one_ranking_for_keep_lens_and_gains():
    gen = torch.Generator().manual_seed(1)
    conf, limit = torch.rand(5, 15, generator=gen), torch.tensor([15, 3, 0, 15, 7])
    Ks = [0, 10, 40, 75]
    sel = dcut.select(conf, limit, Ks)
    log_s = dcut.prefix_scores(conf, limit)
    assert torch.equal(sel.log_s, log_s) and torch.equal(sel.keep_lens, dcut.keep_lens(log_s, Ks))
    assert torch.equal(sel.gains, dcut.gains(dcut.ranking(log_s)[0], Ks))


@SETTINGS
@given(selector_inputs())
def test_gain_is_the_brute_force_sum_of_the_top_K_scores(inputs):
    conf, limit = inputs
    B, D = conf.shape
    Ks = [dcut.budget(r, B, D) for r in RHOS]
    sel = dcut.select(conf, limit, Ks)
    scores = sorted((math.exp(x) for x in sel.log_s.flatten().tolist()), reverse=True)  # exp(-inf) = 0.0
    brute = torch.tensor([sum(scores[:K]) for K in Ks], dtype=torch.float64)
    assert sel.gains.shape == (len(Ks),)
    assert torch.allclose(sel.gains.double(), brute, rtol=1e-5, atol=1e-5)
    assert sel.gains[0] == 0  # rho = 0 verifies no draft


def test_ties_at_confidence_one_still_give_prefixes_summing_to_K():
    # Every score is exactly 1 in rows 0 and 2: ranks among ties must not punch holes in a prefix.
    conf = torch.tensor([[1.0] * 6, [0.5] * 6, [1.0] * 6, [1.0, 1.0, 0.5, 0.5, 0.5, 0.5]])
    log_s = dcut.prefix_scores(conf, torch.tensor([6, 6, 6, 6]))
    Ks = list(range(25))
    keep = dcut.keep_lens(log_s, Ks)
    assert keep.sum(1).tolist() == Ks
    for K in (0, 7, 13, 14, 15):
        kl = keep[K]
        assert int(kl[0] + kl[2] + min(kl[3], 2)) == min(K, 14)  # the fourteen 1.0 scores come first


def test_global_top_K_beats_a_confidence_blind_cut_at_equal_budget():
    """The point of D-cut: at the same K, cut where confidence drops, not at one depth for everyone."""
    B, D = 8, 15
    sure = torch.full((4, D), 0.97)  # drafters that are nearly always right
    guessing = torch.full((4, D), 0.35)  # drafters that are guessing
    conf = torch.cat([sure, guessing])  # [B, D]
    log_s = dcut.prefix_scores(conf, torch.full((B,), D))
    scores = log_s.exp()
    for depth in (2, 4, 8):
        K = B * depth  # the same budget as verifying every request to `depth`
        blind = scores[:, :depth].sum()
        top = scores[kept_mask(dcut.keep_lens(log_s, [K])[0], D)].sum()
        assert torch.isclose(top, dcut.gains(dcut.ranking(log_s)[0], [K])[0])
        assert top > 1.2 * blind, (depth, float(top), float(blind))


def test_compiled_selector_equals_eager_on_a_fixed_shape():
    """dcut.select as the engine traces it: one graph (fullgraph, static shape), same answers."""
    B, D = 8, 15
    Ks = [dcut.budget(r, B, D) for r in (0.0, 0.25, 0.5, 0.75, 1.0)]

    def select(conf, limit):
        sel = dcut.select(conf, limit, Ks)
        return sel.keep_lens, sel.gains

    gen = torch.Generator().manual_seed(0)
    cases = []
    for i in range(4):
        conf = torch.rand(B, D, generator=gen).clamp_min(1e-3)
        if i % 2:
            conf[:3] = 1.0  # exact ties
            conf[5] = 0.5
        limit = torch.randint(0, D + 1, (B,), generator=gen) if i >= 2 else torch.full((B,), D)
        cases.append((conf, limit))
    compiled = torch.compile(select, fullgraph=True, dynamic=False)
    with torch._dynamo.config.patch(error_on_recompile=True):  # one graph for the fixed shape
        for args in cases:
            keep_c, g_c = compiled(*args)
            keep_e, g_e = select(*args)
            assert torch.equal(keep_c, keep_e)
            assert torch.allclose(g_c, g_e, rtol=1e-6, atol=1e-6)

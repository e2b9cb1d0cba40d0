"""Sampling and the acceptance rule (docs/method.md, "Verification"), and the losslessness of speculative
sampling.

The lossless test runs the real Engine at temperature 1 on a target with an 8-token vocabulary and
compares the distribution of the first three generated tokens (8^3 outcomes) with the exact AR
distribution computed from the target's own probabilities. The bound is the total-variation distance
that exact sampling itself stays under (simulated at the same number of runs); a deliberately wrong
acceptance rule run through the same engine must break it.
"""

import pytest
import torch
from safetensors.torch import save_file

import minidcut.graphs
from minidcut.dcut import select
from minidcut.engine import Engine
from minidcut.loader import load_drafter, load_target
from minidcut.policy import Policy
from minidcut.sampling import accept, mix32, nucleus_floor, sample, sample_keys
from tiny import make_drafter, make_model


def keys(n, seed=0, pos=0):
    """Keys of n different requests at one position."""
    return sample_keys(seed, torch.arange(n), torch.full((n,), pos))


# ---- (a) sample -----------------------------------------------------------------------------------

def test_greedy_sample_is_argmax_and_ignores_top_p():
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sample(logits, 0.0, 1.0, keys(64)), logits.argmax(-1))
    assert torch.equal(sample(logits, 0.0, 0.3, keys(64)), logits.argmax(-1))


def test_greedy_sample_breaks_an_exact_tie_like_argmax():
    logits = torch.tensor([[0.0, 1.0, 3.0, 0.5, 3.0]])  # tokens 2 and 4 tie
    assert sample(logits, 0.0, 1.0, keys(1)).tolist() == [2] == logits.argmax(-1).tolist()


def frequencies(logits_row, temperature, top_p, n=40000, seed=0):
    tokens = sample(logits_row.expand(n, -1).contiguous(), temperature, top_p, keys(n, seed))
    return torch.bincount(tokens, minlength=logits_row.shape[-1]).double() / n


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_sampling_follows_the_softmax_at_the_temperature(temperature):
    logits = torch.tensor([1.0, 0.0, -0.5, 2.0, 0.3, -2.0])
    freq = frequencies(logits, temperature, 1.0)
    p = torch.softmax(logits.double() / temperature, -1)
    assert (freq - p).abs().max() < 0.012  # ~5 standard errors at n = 40000


@pytest.mark.parametrize("top_p, nucleus", [(0.45, [2]), (0.7, [2, 0]), (0.85, [2, 0, 3]), (0.99, [2, 0, 3, 1])])
def test_top_p_samples_the_smallest_nucleus_renormalised(top_p, nucleus):
    probs = torch.tensor([0.3, 0.05, 0.5, 0.15])  # sorted: 2 (0.5), 0 (0.3), 3 (0.15), 1 (0.05)
    freq = frequencies(probs.log(), 1.0, top_p)
    expect = torch.zeros(4, dtype=torch.float64)
    expect[nucleus] = probs[nucleus].double() / probs[nucleus].sum()
    assert set(freq.nonzero().flatten().tolist()) == set(nucleus)  # never outside, every member seen
    assert (freq - expect).abs().max() < 0.012


def test_a_tiny_top_p_only_ever_samples_the_argmax():
    torch.manual_seed(0)
    logits = torch.randn(4096, 8)
    for seed in range(5):
        assert torch.equal(sample(logits, 1.0, 1e-6, keys(4096, seed)), logits.argmax(-1))
    assert not torch.equal(sample(logits, 1.0, 1.0, keys(4096)), logits.argmax(-1))  # the control: top_p = 1 samples


def test_a_keyed_draw_depends_on_its_key_alone():
    """The same (seed, request, position) draws the same token wherever it sits in a batch and whatever
    else is in it; another seed, request or position draws independently."""
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    k = sample_keys(7, torch.tensor([3, 1, 4, 1, 5, 9]), torch.tensor([10, 11, 12, 13, 14, 15]))
    a = sample(logits, 1.0, 1.0, k)
    perm = torch.tensor([5, 2, 0, 4, 1, 3])
    assert torch.equal(sample(logits[perm], 1.0, 1.0, k[perm]), a[perm])
    assert torch.equal(sample(logits[:2], 1.0, 1.0, k[:2]), a[:2])
    row = torch.randn(1, 50).expand(2000, -1)
    for other in (sample_keys(8, torch.zeros(2000, dtype=torch.long), torch.arange(2000)),
                  sample_keys(7, torch.arange(2000), torch.zeros(2000, dtype=torch.long))):
        tokens = sample(row, 1.0, 1.0, other)
        assert len(set(tokens.tolist())) > 15  # different keys: different draws


# ---- (b) accept -----------------------------------------------------------------------------------

def lowbias32(x: int) -> int:
    """The reference hash on Python ints (unsigned 32-bit)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_the_int32_hash_is_the_unsigned_32_bit_hash():
    xs = torch.randint(-(2 ** 31), 2 ** 31, (2000,), dtype=torch.int64, generator=torch.Generator().manual_seed(0))
    got = mix32(xs.to(torch.int32)).tolist()
    assert [g & 0xFFFFFFFF for g in got] == [lowbias32(x & 0xFFFFFFFF) for x in xs.tolist()]


def test_sampling_makes_no_int64_temporary_over_the_vocabulary():
    """Keyed noise and the top-p nucleus for T = 8 rows over V = 5000: every tensor the sampler makes
    that spans [T, V] is int32, float32 or bool (an int64 one would be 8 bytes a logit; a sort would
    return int64 indices)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.big = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.numel() >= 8 * 5000:
                    self.big.add(t.dtype)
            return out
    logits = torch.randn(8, 5000)
    keys = sample_keys(0, torch.arange(8), torch.arange(8) + 3)
    for top_p in (1.0, 0.9):
        with Record() as rec:
            sample(logits, 0.8, top_p, keys)
        assert rec.big and torch.int64 not in rec.big, (top_p, rec.big)


def sorted_nucleus(probs, top_p):
    """The reference: sort, keep a token while the mass before it is below top_p. Also the mass
    before each row's first dropped token (the boundary, where float sums may round either way)."""
    sp, order = probs.sort(dim=-1, descending=True)
    before = sp.cumsum(-1) - sp
    keep = torch.zeros_like(probs).scatter(-1, order, (before < top_p).float()).bool()
    return keep, before.gather(1, (before < top_p).sum(-1, keepdim=True).clamp(max=probs.shape[1] - 1))


@pytest.mark.parametrize("scale", [0.5, 2.0, 6.0])
def test_the_nucleus_without_a_sort_is_the_sorted_one(scale):
    """nucleus_floor finds each row's nucleus by bisection: the same tokens as the sorted reference,
    except where the boundary mass is within float rounding of top_p; ties are kept together."""
    g = torch.Generator().manual_seed(int(scale * 10))
    probs = torch.softmax(torch.randn(64, 3000, generator=g) * scale, dim=-1)
    for top_p in (0.05, 0.5, 0.9, 0.99):
        ours = probs >= nucleus_floor(probs, top_p)
        ref, boundary = sorted_nucleus(probs, top_p)
        differ = (ours != ref).any(-1)
        assert ours[:, :].any(-1).all() and (ours.sum(-1) >= 1).all()
        assert not differ[((boundary[:, 0] - top_p).abs() > 1e-5)].any(), (top_p, differ.nonzero())
    tied = torch.tensor([[0.3, 0.2, 0.2, 0.2, 0.1]])  # the mass before the 3rd token is 0.5: all 0.2s kept
    assert (tied >= nucleus_floor(tied, 0.45)).tolist() == [[True, True, True, True, False]]
    assert (tied >= nucleus_floor(tied, 0.3)).tolist() == [[True, False, False, False, False]]


def test_accept_counts_the_matching_prefix_within_keep_len():
    drafts = torch.tensor([[1, 2, 3, 4]] * 6)  # [B, D]
    target = torch.tensor([
        [1, 2, 9, 4, 5],  # mismatch at draft 3
        [1, 2, 9, 4, 5],  # same, but keep_len cuts before the mismatch
        [1, 2, 3, 4, 5],  # all match
        [1, 2, 3, 4, 5],  # all match, nothing kept: an AR step
        [7, 2, 3, 4, 5],  # first draft wrong: later matches do not count
        [1, 2, 3, -1, -1],  # -1 marks unverified cells: never a match
    ])
    keep_len = torch.tensor([4, 1, 4, 0, 4, 2])
    assert accept(drafts, keep_len, target).tolist() == [2, 1, 4, 0, 0, 2]


def test_accept_with_a_greedy_tie_commits_what_ar_would_commit():
    # The target's logits after the anchor tie between tokens 2 and 4: AR commits 2 (argmax picks
    # the first), so a draft of 4 is rejected and the bonus is 2; a draft of 2 is accepted.
    logits = torch.tensor([[0.0, 1.0, 3.0, 0.5, 3.0], [5.0, 0.0, 0.0, 0.0, 0.0]])  # after anchor, after draft
    choice = sample(logits, 0.0, 1.0, keys(2))[None]  # [1, 2]
    assert accept(torch.tensor([[4]]), torch.tensor([1]), choice).tolist() == [0]
    assert choice[0, 0].item() == 2
    assert accept(torch.tensor([[2]]), torch.tensor([1]), choice).tolist() == [1]


# ---- (c) lossless sampling through the engine ------------------------------------------------------

PROMPT = [3, 1, 4, 1]
N = 4096  # independent runs per policy: one prompt repeated, 256 rows at a time


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """An 8-token target and a drafter that mostly drafts its mask token 3 (the target's favourite
    first token), with confidences that vary with the context: acceptance is frequent but not
    certain, so static pruning decides something. Block size 4 (D = 3): with max_new_tokens = 4 at
    most 2 drafts per request can ever be committed, deeper slots would be verified for nothing."""
    root = tmp_path_factory.mktemp("lossless")
    hf = make_model(root / "target", "llama", vocab_size=8)
    W = make_drafter(root / "drafter", hf.config, block_size=4, mask_token_id=3, scale=0.8)
    W["norm.weight"] = W["norm.weight"] * 0.15  # soften the drafter's confidence away from 1.0
    save_file(W, str(root / "drafter" / "model.safetensors"))
    target = load_target(root / "target")
    drafter = load_drafter(root / "drafter", target)
    with torch.no_grad():  # exact AR distribution of the first three tokens [512]
        pairs = torch.cartesian_prod(torch.arange(8), torch.arange(8))  # [64, 2]
        seqs = torch.cat([torch.tensor(PROMPT).expand(64, -1), pairs], 1)  # [64, 6]
        logp = torch.log_softmax(hf(seqs).logits.double(), -1)  # [64, 6, 8]
        first = logp[:, 3].gather(1, pairs[:, :1]) + logp[:, 4].gather(1, pairs[:, 1:])  # [64, 1]
        exact = (first + logp[:, 5]).exp().flatten()  # index t1 * 64 + t2 * 8 + t3
    # The bound: the largest TV that exact sampling itself shows in 1000 trials of N runs (~99.9%).
    gen = torch.Generator().manual_seed(1)
    sims = torch.multinomial(exact.float().expand(1000, -1), N, replacement=True, generator=gen)  # [1000, N]
    counts = torch.zeros(1000, 512, dtype=torch.float64).scatter_add_(
        1, sims, torch.ones_like(sims, dtype=torch.float64))
    null_tv = 0.5 * (counts / N - exact).abs().sum(1)  # [1000]
    return target, drafter, exact, float(null_tv.max())


def tv_to_exact(target, drafter, policy, exact, seed=0):
    """TV between the first three tokens of N engine runs at temperature 1 and the exact AR law."""
    engine = Engine(target, drafter, policy, batch_size=256, max_seq=64, temperature=1.0, seed=seed,
                    eos_ids=[], compile=False)
    outputs, stats = engine.generate([PROMPT] * N, max_new_tokens=4)
    idx = torch.tensor([a * 64 + b * 8 + c for a, b, c, _ in outputs])
    freq = torch.bincount(idx, minlength=512).double() / N
    return float(0.5 * (freq - exact).abs().sum()), stats


def top2_accept(drafts, keep_len, target_tok, top2):
    """A WRONG rule: accept a draft when it is among the target's two most likely tokens."""
    B, D = drafts.shape
    verified = target_tok != -1  # [B, Q]: packed tokens fill these cells in row-major order
    grid = torch.full((*target_tok.shape, 2), -1, dtype=torch.long)
    grid[verified] = top2["last"]  # [T, 2] the target's top-2 in this verify call, in packed order
    near = (drafts[:, :, None] == grid[:, :D]).any(-1) | (drafts == target_tok[:, :D])
    near &= torch.arange(D) < keep_len[:, None]
    return near.int().cumprod(1).sum(1)


def test_speculative_sampling_is_lossless_and_a_wrong_acceptance_rule_is_caught(tiny_pair, monkeypatch):
    target, drafter, exact, bound = tiny_pair
    assert 0.02 < bound < 0.08  # the bound is tight enough to mean something
    # full verifies every draft; static 0.5 keeps K = 384 of the 512 usable first-step drafts
    # (limit 2 per request), chosen by confidence, so some requests are cut to 1 or 0 drafts.
    cut = []  # per draft step: requests whose usable drafts were pruned

    def spy_select(conf, limit, Ks):
        sel = select(conf, limit, Ks)
        cut.append(int((sel.keep_lens < torch.isfinite(sel.log_s).sum(1)).sum()))  # [n_rho, B]
        return sel

    monkeypatch.setattr(minidcut.graphs, "select", spy_select)
    for policy in (Policy.full(), Policy.static(0.5)):
        cut.clear()
        tv, stats = tv_to_exact(target, drafter, policy, exact)
        assert stats.tau > 1.5  # drafts are accepted often: the speculative path is exercised
        assert sum(cut) > 100 if policy.name == "static" else sum(cut) == 0  # static pruning really cut
        assert tv < bound, (policy.label, tv, bound)
    monkeypatch.undo()

    # The same engine with a lossy acceptance rule must be caught by the same bound.
    top2 = {}

    def spy_sample(logits, temperature, top_p, keys):
        top2["last"] = logits.topk(2, dim=-1).indices
        return sample(logits, temperature, top_p, keys)

    monkeypatch.setattr(minidcut.graphs, "sample", spy_sample)
    monkeypatch.setattr(minidcut.graphs, "accept", lambda d, k, t: top2_accept(d, k, t, top2))
    tv, _ = tv_to_exact(target, drafter, Policy.static(0.5), exact)
    assert tv > 2 * bound, (tv, bound)

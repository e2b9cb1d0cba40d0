"""tools/train_drafter.py on a minutes-long tiny configuration: it learns, and what it writes loads
like a z-lab drafter and drafts."""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from minidcut import load_pair
from tiny import make_tokenized_pair
from tools import train_drafter


def test_train_drafter_writes_a_zlab_layout_drafter_that_loads_and_lowers_the_loss(tmp_path):
    target, _ = make_tokenized_pair(tmp_path)
    out = tmp_path / "trained"
    train_drafter.main(["--target", str(target), "--out", str(out), "--corpus", str(tmp_path / "corpus"),
                        "--sequences", "16", "--prompt-len", "24", "--seq-len", "64", "--steps", "40",
                        "--batch-size", "4", "--anchors", "4", "--layers", "1", "--lr", "3e-3", "--taps", "1,3"])
    log = json.loads((out / "train_log.json").read_text())
    assert log["final_loss_ema"] < log["first_loss"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["block_size"] == 16 and cfg["num_target_layers"] == 4
    assert set(cfg["dflash_config"]) == {"mask_token_id", "target_layer_ids"}
    assert cfg["dflash_config"]["target_layer_ids"] == [1, 3]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_norm.weight"} <= keys
    assert not any(k.startswith(("model.", "embed", "lm_head")) for k in keys)
    t, d, _, _ = load_pair(target, out)
    d.setup_cache(1, 64)
    with torch.no_grad():
        logits = d(t, torch.tensor([5]), torch.tensor([0]))
    assert logits.shape == (1, 15, t.cfg.vocab_size)
    # --init continues from that drafter: its architecture, starting at its loss, the recipe in the log.
    more = tmp_path / "more"
    train_drafter.main(["--target", str(target), "--out", str(more), "--corpus", str(tmp_path / "corpus"),
                        "--sequences", "16", "--prompt-len", "24", "--seq-len", "64", "--steps", "5",
                        "--batch-size", "4", "--anchors", "4", "--lr", "1e-3", "--init", str(out), "--seed", "1",
                        "--loss-slots", "4", "--save-every", "2",
                        "--mask-token", "<no such token>"])  # the mask id comes from the drafter it continues
    log2 = json.loads((more / "train_log.json").read_text())
    assert log2["continues"]["command"] == log["command"] and log2["steps"] == 5
    assert log2["first_loss"] < log["first_loss"]
    assert json.loads((more / "config.json").read_text())["dflash_config"] == cfg["dflash_config"]


def test_taps_are_checked_against_the_target():
    assert train_drafter.parse_taps(None, 4) is None
    assert train_drafter.parse_taps("0,3", 4) == [0, 3]
    for bad in ("1,4", "-1", "a,b"):
        with pytest.raises(SystemExit, match="--taps"):
            train_drafter.parse_taps(bad, 4)


def test_from_target_layers_starts_the_draft_layers_as_the_targets_last_layers(tmp_path):
    from minidcut.loader import load_target
    target_dir, _ = make_tokenized_pair(tmp_path)
    target = load_target(target_dir)
    args = train_drafter.parse_args(["--target", str(target_dir), "--out", str(tmp_path / "d"), "--layers", "2",
                                     "--from-target-layers"])
    drafter = train_drafter.build_drafter(args, target, 1)
    for layer, src in zip(drafter.layers, target.model.layers[-2:]):
        theirs = src.state_dict()
        for name, p in layer.state_dict().items():
            if "q_norm" in name or "k_norm" in name:  # the target has none: they start at one
                assert torch.equal(p, torch.ones_like(p)), name
            else:
                assert torch.equal(p, theirs[name]), name
    assert torch.equal(drafter.norm.weight, target.model.norm.weight)
    args.from_target_layers = False
    assert not torch.equal(train_drafter.build_drafter(args, target, 1).layers[0].mlp.up_proj.weight,
                           target.model.layers[-2].mlp.up_proj.weight)


def greedy_data(target, n: int = 6, prompt_len: int = 5, new: int = 40, seed: int = 0):
    """tools/distill.py's data shape: prompts and the target's greedy answers, `starts` at each answer."""
    from minidcut import Engine
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, target.cfg.vocab_size, (prompt_len,), generator=g).tolist() for _ in range(n)]
    outs, _ = Engine(target, None, batch_size=n, max_seq=prompt_len + new + 2, compile=False).generate(prompts, new)
    return {"sequences": [p + o for p, o in zip(prompts, outs)], "starts": [prompt_len] * n}


def test_greedy_data_features_stop_at_the_last_tap_and_label_with_the_next_token(tmp_path):
    from minidcut.loader import load_target
    target = load_target(make_tokenized_pair(tmp_path)[0])
    data = greedy_data(target)
    seqs = [torch.tensor(s) for s in data["sequences"]]
    layers = target.model.layers
    full_f, full_y = train_drafter.target_features(target, seqs, (0, 2))
    calls = []
    for m in (layers[3], target.lm_head):
        m.register_forward_hook(lambda mod, inp, out: calls.append(out.numel()))
    fast_f, fast_y = train_drafter.target_features(target, seqs, (0, 2), greedy_data=True)
    assert calls == [0] * len(calls)  # neither the last layer nor the lm_head did any work
    assert target.model.layers is layers  # the truncation is undone
    for s, st, a, b, ya, yb in zip(seqs, data["starts"], full_f, fast_f, full_y, fast_y):
        assert torch.equal(a, b)
        assert torch.equal(ya[st:-1], yb[st:-1])  # the trained labels: the target's greedy tokens
        assert torch.equal(yb[:-1], s[1:])


def test_data_vocab_trains_the_softmax_over_the_datas_tokens(tmp_path, capsys):
    from minidcut.loader import load_drafter, load_target
    target_dir, _ = make_tokenized_pair(tmp_path)
    data = greedy_data(load_target(target_dir), n=8)
    torch.save(data, tmp_path / "data.pt")
    out = tmp_path / "d"
    train_drafter.main(["--target", str(target_dir), "--out", str(out), "--data", str(tmp_path / "data.pt"),
                        "--steps", "30", "--batch-size", "4", "--anchors", "4", "--layers", "1", "--lr", "3e-3",
                        "--taps", "1,2", "--mask-token-id", "1", "--data-vocab", "--features-dtype", "bfloat16"])
    n = len(set().union(*data["sequences"]))
    assert f"softmax over the {n} of 300 tokens" in capsys.readouterr().out
    log = json.loads((out / "train_log.json").read_text())
    assert log["final_loss_ema"] < log["first_loss"]
    target = load_target(target_dir)
    drafter = load_drafter(out, target)  # it drafts from the vocabulary it was trained over
    assert drafter.draft_vocab.tolist() == sorted(set().union(*data["sequences"]))
    assert torch.equal(drafter.head, target.lm_head.weight[drafter.draft_vocab])


def test_linear_cross_entropy_over_a_subset_of_rows_is_the_restricted_softmax():
    g = torch.Generator().manual_seed(0)
    weight, hidden = torch.randn(50, 8, generator=g), torch.randn(6, 8, generator=g, requires_grad=True)
    vocab = torch.tensor([3, 7, 11, 20, 41])
    y, w = torch.tensor([0, 4, 2, 2, 1, 3]), torch.rand(6, generator=g)
    total, hits = train_drafter.LinearCrossEntropy.apply(hidden, weight[vocab], y, w)
    logits = hidden @ weight[vocab].T
    ref = (w * F.cross_entropy(logits, y, reduction="none")).sum()
    assert torch.allclose(total, ref, atol=1e-5) and torch.equal(hits, logits.argmax(-1) == y)
    (g1,) = torch.autograd.grad(total, hidden)
    (g2,) = torch.autograd.grad(ref, hidden)
    assert torch.allclose(g1, g2, atol=1e-5)


def test_a_features_cache_of_the_first_sequences_is_extended_by_the_rest(tmp_path, monkeypatch):
    """tools/distill.py grows its data file; the cache of the shorter file is reused and only the new
    sequences go through the target. Other data is refused in one line."""
    from minidcut.loader import load_target
    target_dir, _ = make_tokenized_pair(tmp_path)
    data = greedy_data(load_target(target_dir), n=8)
    cache = tmp_path / "feats.pt"

    def train(n: int, name: str):
        torch.save({"sequences": data["sequences"][:n], "starts": data["starts"][:n]}, tmp_path / name)
        train_drafter.main(["--target", str(target_dir), "--out", str(tmp_path / "d"), "--data",
                            str(tmp_path / name), "--steps", "1", "--batch-size", "2", "--anchors", "2",
                            "--layers", "1", "--taps", "1,2", "--mask-token-id", "1", "--features-cache", str(cache)])
        return torch.load(cache)

    five = train(5, "five.pt")
    calls = []
    target_features = train_drafter.target_features
    monkeypatch.setattr(train_drafter, "target_features",
                        lambda t, seqs, *a, **k: calls.append(len(seqs)) or target_features(t, seqs, *a, **k))
    eight = train(8, "eight.pt")
    assert calls == [3]  # only the new sequences
    assert len(eight["feats"]) == 8
    assert all(torch.equal(a, b) for a, b in zip(five["feats"], eight["feats"][:5]))
    fresh, _ = target_features(load_target(target_dir), [torch.tensor(s) for s in data["sequences"]], (1, 2),
                               greedy_data=True)
    assert all(torch.equal(a, b) for a, b in zip(fresh, eight["feats"]))  # as if made in one pass
    data["sequences"][0] = data["sequences"][0][:-1]
    with pytest.raises(SystemExit, match="other taps, dtype or data; delete it"):
        train(8, "other.pt")


def test_a_sampled_answer_is_labelled_with_the_targets_greedy_tokens_not_the_sampled_ones(tmp_path, monkeypatch):
    """Greedy verification accepts only the target's argmax: where tools/distill.py sampled an answer,
    the labels are the target's greedy token after each position of it (a full forward); a greedy
    answer keeps its next tokens (no lm_head)."""
    from minidcut.loader import load_target
    target_dir, _ = make_tokenized_pair(tmp_path)
    target = load_target(target_dir)
    data = greedy_data(target, n=4)
    g = torch.Generator().manual_seed(3)
    data["sequences"][1] = data["sequences"][1][:8] + torch.randint(3, 300, (12,), generator=g).tolist()  # "sampled"
    data["sampled"] = [False, True, False, False]
    torch.save(data, tmp_path / "data.pt")
    cache = tmp_path / "feats.pt"
    train_drafter.main(["--target", str(target_dir), "--out", str(tmp_path / "d"), "--data", str(tmp_path / "data.pt"),
                        "--steps", "1", "--batch-size", "2", "--anchors", "2", "--layers", "1", "--taps", "1,2",
                        "--mask-token-id", "1", "--features-cache", str(cache)])
    labels = torch.load(cache)["labels"]
    seqs = [torch.tensor(s) for s in data["sequences"]]
    _, argmax = train_drafter.target_features(target, seqs, (1, 2))  # full forwards: the target's greedy tokens
    assert torch.equal(labels[1][:-1], argmax[1][:-1]) and not torch.equal(labels[1][:-1], seqs[1][1:])
    for i in (0, 2, 3):
        assert torch.equal(labels[i][:-1], seqs[i][1:])

"""Cost tables (docs/method.md, "Choosing rho"): rows read only where they were measured, missing rows
measured when a run needs them, tables of another machine or setting refused."""

import json

import pytest
import torch
from safetensors.torch import save_file

from minidcut.api import cost_table
from minidcut.cost_model import CostTable, CostTableError, fingerprint, table_path
from minidcut.loader import load_drafter, load_target
from minidcut.profiler import nondecreasing
from tiny import make_drafter, make_model

RHOS = [0.0, 0.25, 0.5, 0.75, 1.0]


def test_cost_table_round_trips_through_json(tmp_path):
    t = CostTable([1, 8], RHOS, [[1, 2, 3, 4, 5], [2, 3, 4, 5, 6]], {"device": "x"})
    back = CostTable.load(t.save(tmp_path / "t.json"))
    assert back.batch_sizes == t.batch_sizes and back.rhos == t.rhos
    assert back.seconds == t.seconds and back.meta == t.meta


def test_rows_are_read_only_at_measured_batch_sizes_never_scaled():
    t = CostTable([8, 16], [0.0, 1.0], [[1.0, 3.0], [2.0, 6.0]])
    assert t.row(8, [0.0, 1.0]) == [1.0, 3.0] and t.row(16, [1.0]) == [6.0]
    assert t.row(12, [0.0, 1.0]) is None and t.row(32, [0.0]) is None  # no interpolation, no scaling
    assert t.row(8, [0.5]) is None  # nor in rho
    t.add_row(12, [1.5, 4.0])
    assert t.batch_sizes == [8, 12, 16] and t.row(12, [1.0]) == [4.0]
    with pytest.raises(CostTableError):
        t.add_row(4, [1.0])


def test_missing_table_is_a_clear_error(tmp_path):
    with pytest.raises(CostTableError, match="not found"):
        CostTable.load(tmp_path / "nope.json")


@pytest.mark.parametrize("text", ["{not json", json.dumps({"rhos": [0, 1]}),
                                  json.dumps({"batch_sizes": [1], "rhos": [0, 1], "seconds": [[1.0]]}),
                                  json.dumps({"batch_sizes": [1], "rhos": [0, 1], "seconds": [[1.0, -2.0]]})])
def test_corrupt_table_is_a_clear_error(tmp_path, text):
    p = tmp_path / "bad.json"
    p.write_text(text)
    with pytest.raises(CostTableError):
        CostTable.load(p)


def test_profiled_costs_are_made_nondecreasing_in_rho_by_pooling_violators():
    assert nondecreasing([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    assert nondecreasing([18.0, 30.0, 19.0, 20.0]) == pytest.approx([18.0, 23.0, 23.0, 23.0])  # one noisy spike
    assert nondecreasing([35.0, 36.0, 32.0, 38.0]) == pytest.approx([34.333, 34.333, 34.333, 38.0], abs=1e-3)
    xs = [5.0, 1.0, 4.0, 2.0, 3.0]
    out = nondecreasing(xs)
    assert all(a <= b for a, b in zip(out, out[1:])) and sum(out) == pytest.approx(sum(xs))


def test_table_path_names_device_models_and_dtype_and_changes_with_a_model_config(tmp_path):
    for name in ("target", "drafter"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text('{"hidden_size": 64}')
    path = table_path("cpu", tmp_path / "target", tmp_path / "drafter", torch.float32, table_dir=tmp_path)
    assert path.parent == tmp_path and path.name.startswith("cpu") and "__target-" in path.name
    assert "__drafter-" in path.name and path.name.endswith("__float32.json")
    mixed = table_path("cpu", tmp_path / "target", tmp_path / "drafter", torch.float32, torch.bfloat16, tmp_path)
    assert mixed.name.endswith("__float32-bfloat16.json")
    assert table_path("cpu", tmp_path / "target", tmp_path / "drafter", torch.float32, table_dir=tmp_path) == path
    (tmp_path / "drafter" / "config.json").write_text('{"hidden_size": 64, "block_size": 8}')  # retrained
    assert table_path("cpu", tmp_path / "target", tmp_path / "drafter", torch.float32, table_dir=tmp_path) != path


def test_a_drafter_that_gains_a_draft_vocabulary_gets_a_new_table_and_new_weights_keep_it(tmp_path):
    """Step costs follow the checkpoint's tensor shapes too: a draft vocabulary shrinks the draft's
    lm_head, so the table name and fingerprint change; retrained weights of the same shapes keep both."""
    hf = make_model(tmp_path / "target", "llama", num_hidden_layers=2)
    W = make_drafter(tmp_path / "drafter", hf.config, n_layers=1, target_layer_ids=[1])

    def keys():
        return (table_path("cpu", tmp_path / "target", tmp_path / "drafter", torch.float32, table_dir=tmp_path),
                fingerprint("cpu", tmp_path / "target", tmp_path / "drafter", torch.float32, False))
    before = keys()
    save_file({k: v + 1 for k, v in W.items()}, str(tmp_path / "drafter" / "model.safetensors"))
    assert keys() == before
    save_file({**W, "draft_vocab": torch.arange(8)}, str(tmp_path / "drafter" / "model.safetensors"))
    after = keys()
    assert after[0] != before[0] and after[1]["drafter_config"] != before[1]["drafter_config"]
    assert after[1]["target_config"] == before[1]["target_config"]


@pytest.fixture
def pair(tmp_path):
    hf = make_model(tmp_path / "target", "llama", num_hidden_layers=2)
    make_drafter(tmp_path / "drafter", hf.config, n_layers=1, target_layer_ids=[1])
    target = load_target(tmp_path / "target")
    return target, load_drafter(tmp_path / "drafter", target), tmp_path


def test_a_run_measures_the_batch_sizes_its_table_lacks_and_reuses_the_rest(pair):
    target, drafter, root = pair
    path = root / "table.json"
    steps = []
    t = cost_table(target, drafter, root / "target", root / "drafter", [1, 2], RHOS, path, compile=False,
                   context_len=16, on_step=lambda B, rho: steps.append(B))
    assert t.batch_sizes == [1, 2] and set(steps) == {1, 2} and path.is_file()
    assert t.meta["fingerprint"] == fingerprint("cpu", root / "target", root / "drafter", torch.float32, False)
    for row in t.seconds:  # drafting steps nondecreasing in rho
        assert all(a <= b for a, b in zip(row[1:], row[2:]))
    steps.clear()
    t2 = cost_table(target, drafter, root / "target", root / "drafter", [1, 2, 4], RHOS, path, compile=False,
                    context_len=16, on_step=lambda B, rho: steps.append(B))
    assert set(steps) == {4} and t2.batch_sizes == [1, 2, 4]  # only the missing row was measured
    assert t2.row(1, RHOS) == t.row(1, RHOS)


def test_a_table_of_another_setting_is_refused_with_one_line_and_remeasured(pair):
    target, drafter, root = pair
    path = root / "table.json"
    stale = CostTable([1], RHOS, [[9.0] * 5], {"fingerprint": {**fingerprint("cpu", root / "target",
                                                                              root / "drafter", torch.float32,
                                                                              False), "threads": 99}})
    stale.save(path)
    said = []
    t = cost_table(target, drafter, root / "target", root / "drafter", [1], RHOS, path, compile=False,
                   context_len=16, log=said.append)
    assert len(said) == 2 and "threads 99 != " in said[0] and "\n" not in said[0]
    assert t.row(1, RHOS) != [9.0] * 5 and t.meta["fingerprint"]["threads"] == torch.get_num_threads()

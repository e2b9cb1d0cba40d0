"""tools/profile.py on a tiny pair (eager): it times every (batch size, rho) cell and writes a cost
table with the metadata the README promises; bad arguments are one-line errors."""

from __future__ import annotations

import pytest

from minidcut.cost_model import CostTable
from tiny import make_drafter, make_model
from tools import profile


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("profile")
    hf = make_model(root / "target", "llama")
    make_drafter(root / "drafter", hf.config)
    return root


def test_profile_writes_a_cost_table_with_metadata(pair, capsys):
    out = pair / "table.json"
    code = profile.main(["--target", str(pair / "target"), "--drafter", str(pair / "drafter"), "--batch-sizes",
                         "2,1", "--rhos", "0,0.5,1", "--context-len", "8", "--repeats", "2", "--warmup", "1",
                         "--no-compile", "--threads", "1", "--out", str(out)])
    assert code == 0
    table = CostTable.load(out)
    assert table.batch_sizes == [1, 2] and table.rhos == [0.0, 0.5, 1.0]
    assert all(c > 0 for row in table.seconds for c in row)
    for key in ("fingerprint", "context_len", "repeats", "date", "relative_spread", "raw_seconds",
                "wall_seconds", "target", "drafter"):
        assert key in table.meta
    assert set(table.meta["fingerprint"]) == {"device", "torch", "threads", "dtype", "drafter_dtype", "compiled", "packed",
                                              "target_config", "drafter_config", "max_seq", "sampling", "method"}
    for row, raw in zip(table.seconds, table.meta["raw_seconds"].values()):
        assert row[0] == raw[0] and row[1] <= row[2]  # the AR step as measured; drafting steps nondecreasing
        assert row[1] + row[2] == pytest.approx(raw[1] + raw[2])  # pooled, not clipped
    assert table.meta["context_len"] == 8 and table.meta["repeats"] == 2
    assert "wrote" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [(["--batch-sizes", "x"], "--batch-sizes"),
                                          (["--context-len", "0"], "--context-len"),
                                          (["--repeats", "0"], "--repeats"), (["--rhos", "a"], "rho grid")])
def test_bad_arguments_are_one_line_errors(pair, argv, message, capsys):
    code = profile.main(["--target", str(pair / "target"), "--drafter", str(pair / "drafter"), "--no-compile",
                         *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error:") and message in err


def test_the_rhos_take_turns_so_a_slow_spell_of_the_machine_hits_every_rho_alike(pair):
    from minidcut.engine import Engine
    from minidcut.loader import load_drafter, load_target
    from minidcut.policy import Policy
    from minidcut.profiler import measure
    target = load_target(pair / "target")
    drafter = load_drafter(pair / "drafter", target)
    order = []
    table = CostTable([], [0.0, 0.5, 1.0], [])
    engine = Engine(target, drafter, Policy("static", table.rhos), batch_size=2, max_seq=64, compile=False)
    measure(table, engine, [2], 8, repeats=3, warmup=1, on_step=lambda B, rho: order.append(rho))
    assert order == [0.0, 0.5, 1.0] + [0.0, 0.5, 1.0] * 3  # warm-up rho by rho, then timed rounds
    assert len(table.seconds[0]) == 3


def test_step_costs_times_every_part_of_a_step(pair, capsys):
    from tools import step_costs
    code = step_costs.main(["--target", str(pair / "target"), "--drafter", str(pair / "drafter"), "--batch-sizes",
                            "1,2", "--context-len", "8", "--repeats", "1", "--threads", "1"])
    out = capsys.readouterr().out
    assert code == 0, out
    for part in ("AR step", "lm_head on B*D rows", "selector", "verify rho=1"):
        assert part in out

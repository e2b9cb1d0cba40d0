"""staging.Staging: a step's host inputs reach the device in one copy, exactly, in put() order."""

from __future__ import annotations

import torch

from minidcut.staging import Staging


def test_parts_arrive_in_order_and_exactly():
    st = Staging(4, "cpu", extra=8)
    st.put([1.5, 2, 3, 4], fixed=True)
    st.put([7, 8, 9])
    st.put(torch.tensor([2**24 - 1, 0, 151_935]))  # integers below 2^24 are exact in float32
    fixed, a, b = st.send()
    assert fixed.tolist() == [1.5, 2, 3, 4] and a.long().tolist() == [7, 8, 9]
    assert b.long().tolist() == [2**24 - 1, 0, 151_935]


def test_growing_keeps_what_was_staged_and_the_draft_inputs_on_the_device():
    st = Staging(3, "cpu", extra=2)
    st.put([1, 2, 3], fixed=True)
    st.send()
    st.fixed_inputs(3).mul_(10)  # a draft made ahead edits its inputs on the device
    st.put([5, 6])
    st.put(list(range(100)))  # more than the buffer holds: it grows
    a, b = st.send()
    assert a.tolist() == [5, 6] and b.long().tolist() == list(range(100))
    assert st.fixed_inputs(3).tolist() == [10, 20, 30]  # untouched: this copy carried no draft inputs


def test_one_copy_per_send(monkeypatch):
    st = Staging(2, "cpu")
    copies = []
    real = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, src, *a, **k: (copies.append(1), real(self, src, *a, **k))[1])
    st.put([1, 2], fixed=True)
    st.put([3])
    st.put([4, 5])
    st.send()
    assert len(copies) == 1
    assert st.send() == [] and len(copies) == 1  # nothing staged: no copy

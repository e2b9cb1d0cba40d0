"""staging.Staging: a step's host inputs reach the device in one copy, exactly, each where its handle says."""

from __future__ import annotations

import torch

from minidcut.staging import Staging


def test_parts_arrive_in_order_and_exactly():
    st = Staging(4, "cpu", extra=8)
    fixed = st.put([1.5, 2, 3, 4], fixed=True)
    a = st.put([7, 8, 9])
    b = st.put(torch.tensor([2**24 - 1, 0, 151_935]))  # integers below 2^24 are exact in float32
    assert a.device is None  # not sent yet
    st.send()
    assert fixed.device.tolist() == [1.5, 2, 3, 4] and a.device.long().tolist() == [7, 8, 9]
    assert b.device.long().tolist() == [2**24 - 1, 0, 151_935]


def test_growing_keeps_what_was_staged_and_the_draft_inputs_on_the_device():
    st = Staging(3, "cpu", extra=2)
    st.put([1, 2, 3], fixed=True)
    st.send()
    st.fixed_inputs(3).mul_(10)  # a draft made ahead edits its inputs on the device
    a = st.put([5, 6])
    b = st.put(list(range(100)))  # more than the buffer holds: it grows
    st.send()
    assert a.device.tolist() == [5, 6] and b.device.long().tolist() == list(range(100))
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
    st.send()
    assert len(copies) == 1  # nothing staged: no copy

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # `from tools import ...`; never tools/ itself (its profile.py)
sys.path.insert(0, str(Path(__file__).resolve().parent))

# Tiny models: one thread is as fast as two and immune to a busy second core.
torch.set_num_threads(1)


@pytest.fixture
def eager_backend(monkeypatch):
    """torch.compile with backend="eager": dynamo traces, guards and counts recompiles as usual, without
    inductor's seconds per graph."""
    real_compile = torch.compile

    def compile_eager(fn, *, mode=None, fullgraph=False, dynamic=None, **_):
        return real_compile(fn, backend="eager", fullgraph=fullgraph, dynamic=dynamic)

    monkeypatch.setattr(torch, "compile", compile_eager)

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # `from tools import ...`; never tools/ itself (its profile.py)
sys.path.insert(0, str(Path(__file__).resolve().parent))

# Tiny models: one thread is as fast as two and immune to a busy second core.
torch.set_num_threads(1)

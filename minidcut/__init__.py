"""minidcut: D-cut adaptive verification-depth pruning for batched speculative decoding, in pure PyTorch.

A DFlash block drafter drafts D = 15 tokens per request in one pass; D-cut keeps the globally most
confident K = rho * B * D draft positions for verification, with rho chosen per step from a cost table
measured on this machine. The output is exactly what the target alone would produce.
"""

from .api import build_policy, load_pair, load_table, load_tokenizer, save_table
from .cost_model import CostTable
from .engine import Engine
from .stats import Stats
from .loader import load_drafter, load_target
from .policy import Policy, StepRecord
from .runtime import default_compile, setup

__all__ = ["setup", "load_pair", "load_tokenizer", "build_policy", "load_table", "save_table", "load_target",
           "load_drafter", "Engine", "Stats", "Policy", "StepRecord", "CostTable", "default_compile"]

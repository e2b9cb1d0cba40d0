"""Cost tables: measured seconds per complete speculative step, by batch size and rho
(PAPER.md section 3 step 5). rho = 0 is an AR step without drafting.

A table lives in compile_cache/cost_tables/<device>__<target>__<drafter>__<dtype>.json and is made by
tools/profile.py (or by the engine's quick profile when none exists).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

TABLE_DIR = Path(__file__).resolve().parent.parent / "compile_cache" / "cost_tables"


class CostTableError(ValueError):
    """A cost table that is missing, unreadable or does not cover what is asked."""


@dataclass
class CostTable:
    batch_sizes: list[int]
    rhos: list[float]
    seconds: list[list[float]]  # [len(batch_sizes)][len(rhos)] median step seconds (profiler.py)
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        s = np.asarray(self.seconds, dtype=float)
        if s.shape != (len(self.batch_sizes), len(self.rhos)):
            raise CostTableError(f"cost table seconds have shape {list(s.shape)}, expected "
                                 f"[{len(self.batch_sizes)}, {len(self.rhos)}]")
        if not np.all(np.isfinite(s)) or np.any(s <= 0):
            raise CostTableError("cost table has non-positive or non-finite entries")
        if sorted(self.batch_sizes) != self.batch_sizes or sorted(self.rhos) != self.rhos:
            raise CostTableError("cost table batch_sizes and rhos must be increasing")

    def cost(self, B: int, rho: float) -> float:
        """Seconds per step at batch size B and budget ratio rho: linear interpolation in rho, and in
        B between profiled sizes (beyond the ends: scaled in proportion to B, the compute-bound limit)."""
        s = np.asarray(self.seconds, dtype=float)
        per_b = np.array([np.interp(rho, self.rhos, row) for row in s])  # [n_b]
        bs = self.batch_sizes
        if B <= bs[0]:
            return float(per_b[0])  # small batches are latency-bound: no cheaper than the smallest
        if B >= bs[-1]:
            return float(per_b[-1] * B / bs[-1])
        return float(np.interp(B, bs, per_b))

    def costs(self, B: int, rhos: list[float]) -> list[float]:
        return [self.cost(B, r) for r in rhos]

    def to_json(self) -> dict:
        return {"batch_sizes": self.batch_sizes, "rhos": self.rhos, "seconds": self.seconds, "meta": self.meta}

    def save(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1))
        return path

    @classmethod
    def load(cls, path: Path) -> "CostTable":
        try:
            d = json.loads(Path(path).read_text())
            return cls([int(b) for b in d["batch_sizes"]], [float(r) for r in d["rhos"]],
                       [[float(x) for x in row] for row in d["seconds"]], d.get("meta", {}))
        except FileNotFoundError:
            raise CostTableError(f"cost table {path} not found") from None
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            if isinstance(e, CostTableError):
                raise
            raise CostTableError(f"cost table {path} is corrupt ({type(e).__name__}: {e}); "
                                 "delete it and run tools/profile.py") from None


def device_name(device) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu{torch.get_num_threads()}t"


def table_path(device, target_dir, drafter_dir, dtype: torch.dtype, table_dir: Path = TABLE_DIR) -> Path:
    """The cost table's file: named by device, target, drafter and dtype."""
    def slug(x) -> str:
        return re.sub(r"[^A-Za-z0-9._-]+", "-", str(x)).strip("-")

    def model(d) -> str:
        """The directory's name, plus a hash of its full path and its config.json: no two models
        collide, and a model retrained into the same directory with another shape gets a new table."""
        p = Path(d).resolve()
        cfg = p / "config.json"
        key = str(p).encode() + (cfg.read_bytes() if cfg.is_file() else b"")
        return f"{slug(p.name)}-{hashlib.sha1(key).hexdigest()[:6]}"
    name = "__".join([slug(device_name(device)), model(target_dir), model(drafter_dir),
                      slug(str(dtype).replace("torch.", ""))])
    return table_dir / f"{name}.json"

"""Cost tables: measured seconds per complete speculative step, by batch bucket and rho
(docs/method.md, "Choosing rho"). rho = 0 is an AR step without drafting.

A table lives in compile_cache/cost_tables/<device>__<target>__<drafter>__<dtype>.json. tools/profile.py
measures whole tables; a run measures the rows it reaches that its table lacks, on its own rows, when
it first steps at that bucket (profiler.measure_live). Such a row stops at the first rho whose cost
means no larger rho can win the step it was measured on: the rest are null in the file (never chosen).
A table is only used for what it was measured on: its `fingerprint` (device, threads, torch, dtypes,
compiled or eager, packed, the two checkpoints' shapes, the cache's positions, greedy or sampled) must
match the run's, and only its own rows are read, never scaled to another bucket.

Every step a dcut run takes refines the entry it ran at (CostTable.refine), and the same file keeps
what the policy learned online (`state`: the gain calibration and the skip decisions,
policy.Policy.state); both are written at the end of every run, so the next process starts from them.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .runtime import write_atomically

TABLE_DIR = Path(__file__).resolve().parent.parent / "compile_cache" / "cost_tables"
# METHOD 7: the AR entry timed in a run of AR steps, the skip evidence's lumps kept apart; 6: the skip decision is a confidence bound; 5: skip states learned from rows at their ends are not reused; 4: a step that does not draft runs
# no fc; 3: a row prunes by full rows; 2: by the rows measured on
METHOD = 7
MEMORY = 20  # a refined entry is the mean of its last ~20 steps' seconds
CLAMP = 3.0  # one step counts at most this many times (or 1 / this) the entry's seconds
SEQ_CLASS = 64  # an eager table serves every run whose cache positions round up to the same multiple of this
MIN_SIZE_CLASS = 256  # compiled caches: the smallest size class (cli.max_seq, size_class)


class CostTableError(ValueError):
    """A cost table that is missing, unreadable or does not cover what is asked."""


@dataclass
class CostTable:
    batch_sizes: list[int]
    rhos: list[float]
    seconds: list[list[float]]  # [len(batch_sizes)][len(rhos)] median step seconds (profiler.py); inf: not measured
    meta: dict = field(default_factory=dict)
    state: dict = field(default_factory=dict)  # the dcut policy's online state (policy.Policy.state)
    samples: list[list[int]] | None = None  # steps behind each entry (default 1 each)

    def __post_init__(self):
        s = np.asarray(self.seconds, dtype=float)
        s = np.where(np.isposinf(s), 1.0, s) if s.size else s  # inf marks an unmeasured entry
        if s.size == 0 and not self.batch_sizes:
            s = s.reshape(0, len(self.rhos))
        if s.shape != (len(self.batch_sizes), len(self.rhos)):
            raise CostTableError(f"cost table seconds have shape {list(s.shape)}, expected "
                                 f"[{len(self.batch_sizes)}, {len(self.rhos)}]")
        if not np.all(np.isfinite(s)) or np.any(s <= 0):
            raise CostTableError("cost table has non-positive or non-finite entries")
        if sorted(self.batch_sizes) != self.batch_sizes or sorted(self.rhos) != self.rhos:
            raise CostTableError("cost table batch_sizes and rhos must be increasing")
        for B, row in zip(self.batch_sizes, self.seconds):  # a row is cut short after its first entry, never before
            if self.rhos and math.isinf(row[0]):
                raise CostTableError(f"cost table row B = {B} has no rho = {self.rhos[0]:g} entry (null): "
                                     "every row starts with a measured step")
        if self.samples is None or np.shape(self.samples) != s.shape:
            self.samples = [[1] * len(self.rhos) for _ in self.batch_sizes]
        self.samples = [[max(1, int(n)) for n in row] for row in self.samples]

    def row(self, B: int, rhos) -> list[float] | None:
        """Seconds per step at bucket B for each of rhos (inf where a row was cut short), None
        without a row at B or if a rho is not in the table."""
        if B not in self.batch_sizes:
            return None
        row = self.seconds[self.batch_sizes.index(B)]
        if rhos == self.rhos:  # every step asks for the whole grid
            return list(row)
        if any(r not in self.rhos for r in rhos):
            return None
        return [row[self.rhos.index(r)] for r in rhos]

    def add_row(self, B: int, seconds: list[float], samples: int | list[int] = 1) -> None:
        """Insert (or replace) the measured row of batch size B (one value per rho of the table), each
        entry the median of `samples` timed steps."""
        if len(seconds) != len(self.rhos):
            raise CostTableError(f"a row of {len(seconds)} costs for a table of {len(self.rhos)} rhos")
        rows = dict(zip(self.batch_sizes, zip(self.seconds, self.samples)))
        rows[B] = (list(seconds), list(samples) if isinstance(samples, list) else [samples] * len(seconds))
        self.batch_sizes = sorted(rows)
        self.seconds = [rows[b][0] for b in self.batch_sizes]
        self.samples = [rows[b][1] for b in self.batch_sizes]

    def refine(self, B: int, rho: float, seconds: float) -> None:
        """Fold a step's measured seconds into the entry (B, rho): a running mean over the entry's
        samples, at most the last MEMORY of them, each clamped to CLAMP times the entry so one stall
        moves it little. What the serving loop pays replaces what a few timed steps measured, run after
        run. Unmeasured entries (inf) stay so."""
        i, j = self.batch_sizes.index(B), self.rhos.index(rho)
        old, n = self.seconds[i][j], min(self.samples[i][j], MEMORY - 1)
        if not math.isinf(old):
            self.seconds[i][j] = (n * old + min(max(seconds, old / CLAMP), old * CLAMP)) / (n + 1)
            self.samples[i][j] = n + 1

    def to_json(self) -> dict:
        seconds = [[None if math.isinf(x) else x for x in row] for row in self.seconds]
        return {"batch_sizes": self.batch_sizes, "rhos": self.rhos, "seconds": seconds, "samples": self.samples,
                "meta": self.meta, "state": self.state}

    def save(self, path: Path) -> Path:
        """Write atomically: a run stopped half-way leaves the previous file whole."""
        return write_atomically(path, lambda tmp: tmp.write_text(json.dumps(self.to_json(), indent=1)))

    @classmethod
    def load(cls, path: Path) -> "CostTable":
        try:
            d = json.loads(Path(path).read_text())
            return cls([int(b) for b in d["batch_sizes"]], [float(r) for r in d["rhos"]],
                       [[math.inf if x is None else float(x) for x in row] for row in d["seconds"]],
                       d.get("meta", {}), d.get("state", {}), d.get("samples"))
        except FileNotFoundError:
            raise CostTableError(f"cost table {path} not found") from None
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            if isinstance(e, CostTableError):
                raise
            raise CostTableError(f"cost table {path} is corrupt ({type(e).__name__}: {e})") from None


def fingerprint(device, target_dir, drafter_dir, dtype: torch.dtype, compiled: bool,
                drafter_dtype: torch.dtype | None = None, packed: bool = False, max_seq: int = 0,
                sampling: str = "greedy") -> dict:
    """What a table's seconds depend on: a table measured under another fingerprint is not used
    (packed: linear layers packed for oneDNN, layers.is_packed; max_seq: the cache positions attention
    reads: all of them when compiled, kept as they are; an eager step reads its live span, kept as
    their seq_class; sampling: greedy, sampled or top-p; method: how the seconds are measured, bumped
    when that changes so older tables are measured again)."""
    def shape_hash(d) -> str:
        key = shape_key(d)
        return hashlib.sha1(key).hexdigest()[:12] if key else "none"
    return {"device": device_name(device), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "dtype": str(dtype).replace("torch.", ""),
            "drafter_dtype": str(drafter_dtype or dtype).replace("torch.", ""), "compiled": bool(compiled),
            "packed": bool(packed), "max_seq": int(max_seq) if compiled else seq_class(max_seq),
            "sampling": sampling, "method": METHOD,
            "target_config": shape_hash(target_dir), "drafter_config": shape_hash(drafter_dir)}


def size_class(positions: int) -> int:
    """Cache positions of a compiled run that needs `positions`: the next power of two, at least
    MIN_SIZE_CLASS. Its graphs and cost table are shared by every run of the class, whatever its prompts
    and token counts (at most 2x the attention positions it needs)."""
    return max(MIN_SIZE_CLASS, 1 << (int(positions) - 1).bit_length())


def seq_class(max_seq: int) -> int:
    """The cache positions an eager run's table is keyed by: max_seq rounded up to a multiple of
    SEQ_CLASS, so that runs of similar lengths share a table (an eager run sizes its cache closer to
    what it needs, cli.max_seq; a compiled run's graphs read every position, so its table is keyed by
    the positions themselves, which cli.max_seq rounds to a size class within the target's)."""
    return -(-int(max_seq) // SEQ_CLASS) * SEQ_CLASS


def shape_key(d) -> bytes:
    """What a model directory's step costs follow from: its config.json and its checkpoint's tensor
    names, dtypes and shapes (the safetensors header, or the shard index), so a drafter that gains a
    draft vocabulary gets a new table and one retrained with the same shapes keeps its table."""
    p = Path(d)
    key = (p / "config.json").read_bytes() if (p / "config.json").is_file() else b""
    if (p / "model.safetensors").is_file():
        with open(p / "model.safetensors", "rb") as f:
            key += f.read(int.from_bytes(f.read(8), "little"))
    elif (p / "model.safetensors.index.json").is_file():
        key += (p / "model.safetensors.index.json").read_bytes()
    return key


def device_name(device) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu{torch.get_num_threads()}t"


def table_path(fp: dict, target_dir, drafter_dir, table_dir: Path = TABLE_DIR) -> Path:
    """The cost table's file for a run of fingerprint fp: named by device, target, drafter, dtypes and
    the cache's positions, plus a hash of the whole fingerprint, so runs that differ in anything a
    step's cost depends on keep separate files."""
    def slug(x) -> str:
        return re.sub(r"[^A-Za-z0-9._-]+", "-", str(x)).strip("-")

    def model(d) -> str:
        """The directory's name, plus a hash of its full path: no two models collide."""
        p = Path(d).resolve()
        return f"{slug(p.name)}-{hashlib.sha1(str(p).encode()).hexdigest()[:6]}"
    dtypes = "-".join(dict.fromkeys([fp["dtype"], fp["drafter_dtype"]]))
    digest = hashlib.sha1(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:8]
    name = "__".join([slug(fp["device"]), model(target_dir), model(drafter_dir), slug(dtypes),
                      f"seq{fp['max_seq']}-{digest}"])
    return table_dir / f"{name}.json"

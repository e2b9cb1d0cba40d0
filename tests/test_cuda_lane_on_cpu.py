"""The GPU lane (tests/test_cuda.py) eagerly on the CPU: every test but the CUDA graph replay count,
in a subprocess (the lane picks its device at import). It checks interfaces and exactness, not CUDA
graphs: those need a GPU (tools/gpu_check.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_cuda_lane_passes_eagerly_on_the_cpu():
    env = dict(os.environ, MINIDCUT_CUDA_LANE_ON_CPU="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider",
                           "tests/test_cuda.py"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    tail = proc.stdout[-3000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    counts = dict((k, int(n)) for n, k in re.findall(r"(\d+) (passed|skipped|failed|error)", proc.stdout))
    assert counts.get("passed", 0) >= 14 and counts.get("skipped") == 1, tail  # only the replay count skips

"""Text normalisation and a near-duplicate filter for prompt files (tools/prompt_sources.py, tools/magpie.py).

words      lowercase word tokens, punctuation dropped: what "the same text" means for dedup and for
           decontamination (tools/decontaminate.py)
NearDup    a streaming filter: `add(text)` keeps a text unless it is an exact duplicate (same words) or a
           near duplicate of one kept before (Jaccard similarity of word 3-gram sets >= threshold),
           found through MinHash signatures with banded locality-sensitive hashing, then checked exactly
"""

from __future__ import annotations

import hashlib
import re

import numpy as np

WORD = re.compile(r"[a-z0-9]+")
PRIME = (1 << 31) - 1  # hashes mod a 31-bit prime: a * h + b stays inside uint64


def words(text: str) -> list[str]:
    """Lowercase alphanumeric tokens: case, whitespace and punctuation do not make texts differ."""
    return WORD.findall(text.lower())


def shingles(ws: list[str], n: int = 3) -> set[str]:
    """The text's word n-grams (the whole text when it is shorter than n words)."""
    if len(ws) <= n:
        return {" ".join(ws)}
    return {" ".join(ws[i:i + n]) for i in range(len(ws) - n + 1)}


def _hash64(s: str) -> int:
    return int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "little")


class NearDup:
    """Keep-first filter over a stream of texts (exact, then near duplicates; see the module docstring)."""

    def __init__(self, threshold: float = 0.7, n: int = 3, bands: int = 20, rows: int = 5, seed: int = 0):
        # 20 bands of 5 rows: two texts at Jaccard 0.7 share a band with probability 1 - (1 - 0.7^5)^20
        # = 0.97; at 0.3, 0.05 (and every candidate is checked exactly, so this only costs time).
        self.threshold, self.n, self.bands, self.rows = threshold, n, bands, rows
        rng = np.random.default_rng(seed)
        k = bands * rows
        self.a = rng.integers(1, PRIME, (k, 1), dtype=np.uint64)
        self.b = rng.integers(0, PRIME, (k, 1), dtype=np.uint64)
        self.exact: dict[str, int] = {}  # words of a kept text -> its index
        self.kept: list[set[str]] = []
        self.buckets: list[dict] = [{} for _ in range(bands)]

    def signature(self, grams: set[str]) -> np.ndarray:
        """MinHash: per hash function (a * h + b) mod PRIME, the minimum over the text's n-grams."""
        h = np.array([_hash64(g) % PRIME for g in grams], dtype=np.uint64)
        return ((self.a * h[None] + self.b) % PRIME).min(1)

    def add(self, text: str) -> tuple[str, int]:
        """('kept', its index), or ('exact' | 'near', the index of the kept text it repeats); indices
        count the kept texts in the order they were kept."""
        ws = words(text)
        key = " ".join(ws)
        if key in self.exact:
            return "exact", self.exact[key]
        grams = shingles(ws, self.n)
        sig = self.signature(grams)
        keys = [sig[band * self.rows:(band + 1) * self.rows].tobytes() for band in range(self.bands)]
        for band, k in enumerate(keys):
            for j in self.buckets[band].get(k, ()):
                other = self.kept[j]
                if len(grams & other) >= self.threshold * len(grams | other):
                    return "near", j
        i = len(self.kept)
        self.exact[key] = i
        for band, k in enumerate(keys):
            self.buckets[band].setdefault(k, []).append(i)
        self.kept.append(grams)
        return "kept", i

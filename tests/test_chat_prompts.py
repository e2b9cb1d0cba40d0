"""tools/chat_prompts.py: the second round of training prompts leaves the first round as it was (data files
distilled from the first N prompts stay valid) and gives every definition a different task."""

import random

from tools import chat_prompts

SOURCE = '''"""A module whose docstring is long enough to be summarised by a chat prompt, forty characters."""


def add(a, b):
    """Return the sum of a and b."""
    return a + b


def scale(xs, k=2):
    """Multiply every item of xs by k."""
    return [x * k for x in xs]


class Box:
    """Hold one value until it is taken."""

    def take(self):
        """Give the value back and forget it."""
        return self.value
'''


def test_the_second_round_keeps_the_first_and_picks_other_templates(tmp_path, monkeypatch):
    (tmp_path / "mod.py").write_text(SOURCE)
    monkeypatch.setattr(chat_prompts.corpus, "list_files", lambda split: [tmp_path / "mod.py"])
    firsts, seconds = [], []
    for seed2 in range(4):
        first, second = chat_prompts.stdlib_tasks(random.Random(0), random.Random(seed2))
        firsts.append(first)
        seconds.append(second)
    assert len(firsts[0]) == 5  # the module, add, scale, Box, take
    assert all(f == firsts[0] for f in firsts)  # the first round does not depend on the second's generator
    assert len({tuple(s) for s in seconds}) > 1
    for first, second in zip(firsts, seconds):
        assert len(second) == len(first)
        assert all(a != b for a, b in zip(first, second))
    assert "`mod`" in firsts[0][0] and "`mod`" in seconds[0][0]  # both module templates name it

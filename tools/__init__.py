"""Offline tools that make minidcut's demo checkpoints: corpus, tokenizer, target training.

Run them from the repository root as modules, e.g. `python -m tools.train_target --help`.
"""

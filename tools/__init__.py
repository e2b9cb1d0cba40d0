"""Tools beside the engine, each a script whose docstring gives its commands: cost tables
(profile.py), measurements (oneshot.py, worst_case.py, gpu_check.py, first_hour.py), the real pair
(get_smollm2.py, target_parts.py), training data and drafters (prompt_sources.py, distill.py, train_drafter.py,
eval_pair.py, gpu_drafter.py) and the demo models (corpus.py, train_tokenizer.py, train_target.py)."""

"""Sparse long-context training, end to end (docs/TRAINING.md): a small Qwen2
LM trained on MQAR and passkey retrieval with dense, mtrain and sliding-window
attention. ``python -m examples.train --help``; the charts:
``python -m examples.train.report``."""

"""Suite-wide settings.

CI runs ``pytest -n 2`` on two cores: each worker gets one intra-op thread, so
the two workers do not oversubscribe the machine (tiny matmuls were measured
to slow down 5-10x with two threads per worker).
"""

import os

import torch

torch.set_num_threads(int(os.environ.get("GWT_TEST_THREADS", "1")))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

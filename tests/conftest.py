"""Suite-wide settings.

CI runs ``pytest -n 2`` on two cores: each worker gets one intra-op thread, so
the two workers do not oversubscribe the machine (tiny matmuls were measured
to slow down 5-10x with two threads per worker).
"""

import os
import signal

import pytest
import torch

torch.set_num_threads(int(os.environ.get("GWT_TEST_THREADS", "1")))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


@pytest.fixture
def terminal_signals():
    """SIGINT and SIGTERM as at a terminal for the test, restored after it.

    A test that sends a real signal must not depend on what its pytest-xdist
    worker inherited or what an earlier test in that worker left: a worker
    started as a background job (``nohup ... &``, some CI runners) ignores
    SIGINT, and an ignored signal is inherited by every child it starts, where
    training then honours it (it installs no handler for an ignored signal).
    Python's own handlers are also what a child started during the test gets:
    a caught signal goes back to its default across ``exec``, so no
    ``preexec_fn`` is needed."""
    previous = {sig: signal.signal(sig, handler)
                for sig, handler in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL))}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            if handler is not None:  # None: a handler installed outside Python, which cannot be put back
                signal.signal(sig, handler)


def pytest_collection_modifyitems(config, items):
    """Tests that wait on another test's output run last.

    A test that reads what a slow test writes into a session-wide folder
    (``{runs}`` in tests/test_documented_commands.py) blocks its pytest-xdist
    worker on that test's lock if it is handed out early: one core then idles
    for as long as the writer runs (about 45 s for the demo's ``report``).
    Handed out last, it finds the writer done. Sorting is stable, so the order
    is otherwise the files' own, and it is the same in every worker, as xdist
    requires. (Starting the slow tests first was tried: it pairs tests that
    mostly wait on signals and rendezvous, and the suite took 100 s longer.)"""
    items.sort(key=lambda item: item.get_closest_marker("reads_shared") is not None)

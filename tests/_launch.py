"""The one launcher of the suite's multi-process tests: ``launch(worker, world, tmp_path, *args)``
runs ``worker(rank, *args)`` in ``world`` fresh processes, each a rank of a gloo process group
(a file store in ``tmp_path``), and fails the test with a rank's traceback if one raises.

The processes are forked from a server process that imported torch, its distributed packages
and gwt_optim once (``forkserver`` with those preloaded), not started bare (``spawn``): a spawned
process paid those imports itself, about 3.5 s of CPU per rank on a 2-core machine (a 2-rank
test took 18-20 s of CPU spawned, 12-13 s forked), and the suite's six launches start 16 ranks.
A forked rank starts with those modules imported and imports only its test module. The server
is started by the first launch in each pytest(-xdist) worker and serves every later one.

Each rank gets, as ``spawn`` gave it, the launching test's environment and working directory
(the server has its own, from when it started), and the launching process's number of intra-op
threads (one in the suite, conftest.py): a spawned rank took one per core, and 4 ranks of 2 threads
oversubscribe the CI's 2 cores.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Set at import, so before the first launch starts the server (the preload cannot change after).
multiprocessing.get_context("forkserver").set_forkserver_preload(
    ["torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor",
     "torch.distributed.checkpoint", "torch.distributed.checkpoint.state_dict", "gwt_optim", "pytest"])

# A rank stuck in a collective (a peer died before it) would hang the test: gloo gives up after this,
# and the launcher stops the ranks after LAUNCH_TIMEOUT, failing the test with what they said.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)
LAUNCH_TIMEOUT = 600.0


def launch(worker, world: int, tmp_path, *args, group: bool = True) -> None:
    """``worker(rank, *args)`` on ranks ``0..world-1``, inside the process group, which is destroyed after
    it. ``group=False`` leaves the group to the worker (a test of what happens before one exists): it
    calls :func:`join_group` with ``rank`` and ``world`` itself."""
    store = os.path.join(str(tmp_path), "store")
    context = mp.start_processes(
        _entry, args=(worker, world, store, group, dict(os.environ), os.getcwd(), torch.get_num_threads(), args),
        nprocs=world, join=False, start_method="forkserver")
    deadline = time.monotonic() + LAUNCH_TIMEOUT
    while not context.join(timeout=max(0.0, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for process in context.processes:
                if process.is_alive():
                    process.terminate()
            raise TimeoutError(f"{worker.__module__}.{worker.__name__}: {world} ranks still running after "
                               f"{LAUNCH_TIMEOUT:.0f} s")


def join_group(rank: int, world: int) -> None:
    """The launch's gloo process group, for a worker started with ``group=False``."""
    dist.init_process_group("gloo", init_method=f"file://{os.environ['GWT_TEST_STORE']}", rank=rank,
                            world_size=world, timeout=COLLECTIVE_TIMEOUT)


def _entry(rank, worker, world, store, group, environ, cwd, threads, args):
    os.environ.clear()
    os.environ.update(environ, GWT_TEST_STORE=store)
    os.chdir(cwd)
    torch.set_num_threads(threads)
    if not group:
        worker(rank, *args)
        return
    join_group(rank, world)
    try:
        worker(rank, *args)
    finally:
        dist.destroy_process_group()

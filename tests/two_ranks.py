"""Two torch.distributed ranks as spawned processes, for the EP and TP worker tests.

`run_two_ranks(target, args_of, timeout_s)` starts `target(rank, port, *args_of(rank), results)` for ranks 0 and 1,
`port` that of a TCPStore this process hosts on a port the OS chose (tests/ports.py; a rank joins with
`join_gloo(rank, 2, port)`); each rank puts (rank, value) on `results` (a traceback string when it fails). It returns
{rank: value} for the ranks in `answering` (a rank that is meant to die answers nothing), and kills any rank still
alive 30 s after that.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable

from ports import tcp_store


def run_two_ranks(
    target: Callable[..., None], args_of: Callable[[int], tuple], timeout_s: float, answering: tuple[int, ...] = (0, 1)
) -> dict[int, object]:
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    store = tcp_store()  # held until both ranks are done
    procs = [ctx.Process(target=target, args=(rank, store.port, *args_of(rank), results)) for rank in (0, 1)]
    for proc in procs:
        proc.start()
    got = {}
    try:
        for _ in answering:
            rank, value = results.get(timeout=timeout_s)
            got[rank] = value
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    return got

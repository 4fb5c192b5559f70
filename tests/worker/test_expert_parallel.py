"""Expert parallelism below the worker: the token exchange of `ExpertParallel.run_experts` over a real
2-process gloo group equals the one-rank computation (uneven token counts, a rank with none), the group
agreement and wake channel of `GroupSync`, and a dead member turning the next collective into GroupBroken
instead of a hang. Flag resolution from torchrun / Slurm environments."""

from __future__ import annotations

import os
import time
import traceback

import pytest
import torch
from ports import join_gloo
from two_ranks import run_two_ranks

from infer.worker.distributed.expert_parallel import ExpertParallel
from infer.worker.distributed.group_sync import EpOptions

NUM_EXPERTS, HIDDEN, TOP_K = 4, 8, 2


def _expert_weights() -> torch.Tensor:
    return torch.randn(NUM_EXPERTS, HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(7))


def _inputs(rank: int, num_tokens: int):
    generator = torch.Generator().manual_seed(100 + rank)
    hidden = torch.randn(num_tokens, HIDDEN, generator=generator)
    scores = torch.randn(num_tokens, NUM_EXPERTS, generator=generator).softmax(-1)
    weights, ids = scores.topk(TOP_K, dim=-1)
    return hidden, ids, weights


def _run_experts(ep: ExpertParallel, hidden, ids, weights) -> torch.Tensor:
    local = _expert_weights()[ep.expert_range(NUM_EXPERTS).start : ep.expert_range(NUM_EXPERTS).stop]

    def experts(rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        assert local_ids.numel() == 0 or (int(local_ids.min()) >= 0 and int(local_ids.max()) < len(local))
        return torch.einsum("nh,nho->no", rows, local[local_ids])

    return ep.run_experts(hidden, ids, weights, NUM_EXPERTS, experts)


def _rank_main(rank: int, port: int, tokens: list[int], scenario: str, results) -> None:
    import zmq

    from infer.worker.distributed.group_sync import GroupBroken, GroupSync

    try:
        options = EpOptions(size=2, rank=rank, dist_init=f"tcp://127.0.0.1:{port}", timeout_s=20)
        join_gloo(rank, 2, port)
        ep = ExpertParallel(rank=rank, size=2)
        if scenario == "exchange":
            out = [_run_experts(ep, *_inputs(rank, n)) for n in tokens]  # one call per "layer"
            results.put((rank, [o.tolist() for o in out]))
        elif scenario == "agree":
            sync = GroupSync(options, zmq.Context.instance())
            seen = []
            if rank == 0:  # the idle group: rank 0 gets work, wakes rank 1, both agree
                sync.wake_peers()
                seen.append(sync.agree(True, False))
                seen.append(sync.agree(False, False))  # nobody has work: the group goes idle
                seen.append(sync.agree(True, False))
            else:
                deadline = time.monotonic() + 10
                while not sync.woken():
                    assert time.monotonic() < deadline, "no wake"
                    time.sleep(0.01)
                seen.append(sync.agree(False, False))
                seen.append(sync.agree(False, False))
                seen.append(sync.agree(False, True, draining=True))  # its drain and departure reach rank 0
                sync.wake_peers()  # a wake for round 3, then a stale one for round 0 from the past
            seen = [(a.work, a.leaving, a.draining) for a in seen]
            seen.append(sync.round)
            results.put((rank, seen))
            sync.close()
        elif scenario == "member-dies":
            if rank == 1:
                os._exit(0)  # a member gone without a word
            time.sleep(0.5)
            try:
                _run_experts(ep, *_inputs(rank, 3))
                results.put((rank, "no error"))
            except GroupBroken as e:
                results.put((rank, f"broken: {e}"))
    except BaseException:
        results.put((rank, traceback.format_exc()))


def _spawn(scenario: str, tokens: list[list[int]]) -> dict[int, object]:
    return run_two_ranks(
        _rank_main,
        lambda rank: (tokens[rank], scenario),
        timeout_s=60,
        answering=(0,) if scenario == "member-dies" else (0, 1),
    )


def test_two_rank_exchange_equals_one_rank():
    """Rank 0 has 5 then 0 tokens, rank 1 has 3 then 4: every call is a collective both ranks join, and each
    rank's output equals running all experts locally."""
    tokens = [[5, 0], [3, 4]]
    got = _spawn("exchange", tokens)
    for rank in (0, 1):
        assert isinstance(got[rank], list), got[rank]
        for n, out in zip(tokens[rank], got[rank], strict=True):
            want = _run_experts(ExpertParallel.single(), *_inputs(rank, n))
            torch.testing.assert_close(torch.tensor(out).reshape(n, HIDDEN), want, rtol=1e-6, atol=1e-6)


def test_group_sync_wakes_an_idle_peer_and_agrees():
    """Rounds agree on (work, leaving, draining) OR-ed over the group: rank 0's work, then nobody's, then rank 1's
    drain and departure with rank 0's work."""
    got = _spawn("agree", [[], []])
    want = [(True, False, False), (False, False, False), (True, True, True), 3]
    assert got[0] == want, got[0]
    assert got[1] == want, got[1]


def test_a_dead_member_breaks_the_exchange_instead_of_hanging():
    got = _spawn("member-dies", [[], []])
    assert str(got[0]).startswith("broken: EP group exchange failed"), got[0]


def test_ep_options_from_flags_torchrun_and_slurm():
    flags = EpOptions.resolve(2, 1, "tcp://10.0.0.1:29500", 30, env={})
    assert (flags.rank, flags.dist_init) == (1, "tcp://10.0.0.1:29500")
    assert flags.default_group_id == "ep-10.0.0.1:29500"
    torchrun = EpOptions.resolve(4, None, None, 30, env={"RANK": "3", "MASTER_ADDR": "h", "MASTER_PORT": "7"})
    assert (torchrun.rank, torchrun.dist_init) == (3, "tcp://h:7")
    slurm_env = {"SLURM_PROCID": "5", "MASTER_ADDR": "n1", "MASTER_PORT": "9"}
    slurm = EpOptions.resolve(2, None, None, 30, env=slurm_env)
    assert slurm.rank == 1
    with pytest.raises(ValueError, match="needs --ep-rank"):
        EpOptions.resolve(2, None, "tcp://h:1", 30, env={})
    with pytest.raises(ValueError, match="needs --dist-init"):
        EpOptions.resolve(2, 0, None, 30, env={})
    with pytest.raises(ValueError, match=r"--ep-rank must be in \[0, 2\)"):
        EpOptions(size=2, rank=2, dist_init="tcp://h:1")
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        EpOptions(size=2, rank=0, dist_init="h:1")
    with pytest.raises(ValueError, match="SLURM_PROCID must be an integer"):
        EpOptions.resolve(2, None, "tcp://h:1", 30, env={"SLURM_PROCID": "x"})


def _join_with_size(rank: int, size: int, port: int, results) -> None:
    try:
        opts = EpOptions(size=size, rank=rank, dist_init=f"tcp://127.0.0.1:{port}", timeout_s=20)
        ExpertParallel.join(opts, torch.device("cpu"))
        results.put((rank, "joined"))
    except ValueError as e:
        results.put((rank, str(e)))


def test_a_member_started_with_another_ep_size_is_refused_by_name_on_both_sides():
    """Rank 0 (--ep-size 2) and rank 1 (--ep-size 3) at one rendezvous: each leaves with a ValueError naming the
    flag and both sizes, well before the 20 s timeout a bare init_process_group would wait out."""
    import multiprocessing

    from infer.protocol.ports import reserved_port

    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = reserved_port()
    procs = [ctx.Process(target=_join_with_size, args=(rank, size, port, results)) for rank, size in ((0, 2), (1, 3))]
    for proc in procs:
        proc.start()
    try:
        got = dict(results.get(timeout=60) for _ in procs)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    assert "this process (global rank 1) was started with --ep-size = EP 3, but global rank 0" in got[1], got
    assert "this process (global rank 0) was started with --ep-size = EP 2, but global rank 1" in got[0], got
    assert all("EP 2" in text and "EP 3" in text and "same sizes" in text for text in got.values()), got

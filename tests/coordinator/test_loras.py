"""The coordinator's LoRA job frame by frame (coordinator/loras.py): a load goes to every healthy worker and is
answered once all did (with every worker's error), one command at a time, a dead worker fails its part, the
cluster's adapters reach a worker that registers later and show in ClusterStats."""

from __future__ import annotations

from core_harness import Harness, worker_hello

from infer.protocol.messages import ClusterStats, Error, Hello, LoraCommand, LoraDone, StatsRequest

ADMIN = b"admin"
LOAD = LoraCommand(action="load", lora_name="sql", lora_path="/adapters/sql")


def _cluster(workers: int = 2) -> Harness:
    h = Harness()
    for i in range(workers):
        h.worker(f"w{i}", i)
    h.send(ADMIN, Hello(role="client", peer_id="admin"))
    return h


def _done(wid: str, error: str | None = None, adapters: dict | None = None) -> LoraDone:
    return LoraDone(
        action="load",
        lora_name="sql",
        error=error,
        lora_adapters={"sql": "/adapters/sql"} if adapters is None and error is None else adapters or {},
    )


def test_a_load_reaches_every_worker_and_answers_once_all_did():
    h = _cluster()
    out = h.send(ADMIN, LOAD)
    assert sorted(i for i, m in out if isinstance(m, LoraCommand)) == [b"w0", b"w1"]
    assert h.send(b"w0", _done("w0")) == []  # one of two: no answer yet
    out = h.send(b"w1", _done("w1"))
    assert out == [(ADMIN, LoraDone(action="load", lora_name="sql", lora_adapters={"sql": "/adapters/sql"}))]
    stats = next(m for _, m in h.send(ADMIN, StatsRequest()) if isinstance(m, ClusterStats))
    assert stats.lora_adapters == {"sql": "/adapters/sql"}
    out = h.send(b"w2", worker_hello("w2", 2))  # a later worker gets the cluster's adapters
    assert (b"w2", LOAD) in out


def test_errors_name_the_workers_and_one_command_runs_at_a_time():
    h = _cluster()
    h.send(ADMIN, LOAD)
    out = h.send(ADMIN, LoraCommand(action="unload", lora_name="sql"))
    assert isinstance(out[0][1], Error) and "still waiting for the workers" in out[0][1].message
    h.send(b"w0", _done("w0", error="/adapters/sql/adapter_config.json: no such file"))
    [(client, answer)] = h.send(b"w1", _done("w1", error="rank 64, above --max-lora-rank 16"))
    assert client == ADMIN and "worker w0: /adapters/sql/adapter_config.json: no such file" in answer.error
    assert "worker w1: rank 64" in answer.error and answer.lora_adapters == {}
    assert h.core.loras.adapters == {}  # nobody loaded it: nothing for later workers


def test_a_worker_that_dies_before_it_answers_fails_its_part():
    h = _cluster()
    h.send(ADMIN, LOAD)
    h.send(b"w0", _done("w0"))
    out = h.advance(2.0) + h.advance(0.01)  # w1 silent past the worker timeout
    answers = [m for i, m in out if i == ADMIN and isinstance(m, LoraDone)]
    assert answers and "worker w1: the worker died before it answered" in answers[0].error
    assert h.core.loras.adapters == {"sql": "/adapters/sql"}  # w0 serves it: the cluster's table has it


def test_a_load_named_after_the_clusters_model_is_refused_before_any_worker_sees_it():
    h = _cluster()
    out = h.send(ADMIN, LoraCommand(action="load", lora_name=h.core.status.model_id, lora_path="/adapters/sql"))
    assert [i for i, _ in out] == [ADMIN] and isinstance(out[0][1], Error)
    assert "the name is the base model's" in out[0][1].message
    assert h.core.loras.barrier is None  # nothing pending: the next command runs
    assert sorted(i for i, m in h.send(ADMIN, LOAD) if isinstance(m, LoraCommand)) == [b"w0", b"w1"]

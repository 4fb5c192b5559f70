"""Many models behind one coordinator (coordinator/models.py), driven frame by frame: each model's workers, ranks and
groups apart; a request routed by its model (an adapter by its base's workers); refusals that name what is served;
per-model queues and stats; --model-id as the pinned list and the default."""

from __future__ import annotations

from core_harness import MODEL, Harness, client_deltas, delta, dispatches, worker_hello

from infer.protocol.messages import (
    MAX_TOKENIZER_SOURCES,
    ClusterStats,
    Error,
    Hello,
    LoraCommand,
    Message,
    Refused,
    StatsRequest,
    Welcome,
    decode,
    encode,
)

C1 = b"client-1"
ADMIN = b"admin"
OTHER = "other-model"


def of_type(out: list[tuple[bytes, Message]], kind: type, to: bytes | None = None) -> list:
    return [m for identity, m in out if isinstance(m, kind) and (to is None or identity == to)]


def two_models(**options) -> Harness:
    """w0, w1: MODEL (ranks 0, 1); v0: OTHER (rank 0, with the LoRA adapter "sql")."""
    h = Harness(**options)
    h.worker("w0", 0)
    h.worker("w1", 1)
    h.send(b"v0", worker_hello("v0", 0, model=OTHER, lora_adapters={"sql": "/adapters/sql"}))
    return h


def routed(out: list[tuple[bytes, Message]]) -> dict[str, list[str]]:
    """request id -> the worker ids it was dispatched to."""
    where: dict[str, list[str]] = {}
    for identity, sent in dispatches(out).items():
        for d in sent:
            where.setdefault(d.request_id, []).append(identity.decode())
    return where


def test_each_model_has_its_own_ranks_and_groups():
    h = two_models()
    assert {w.worker_id: (w.model_id, w.dp_rank) for w in h.core.workers} == {
        "w0": (MODEL, 0),
        "w1": (MODEL, 1),
        "v0": (OTHER, 0),  # rank 0 again: the other model's
    }
    # an assigned rank is the lowest free among its model's
    (welcome,) = of_type(h.send(b"v1", worker_hello("v1", None, model=OTHER)), Welcome, b"v1")
    assert (welcome.dp_rank, welcome.group_id) == (1, "dp1")
    # a duplicate within one model is still refused, naming the model
    (refused,) = of_type(h.send(b"v9", worker_hello("v9", 0, model=OTHER)), Refused)
    assert f"duplicate dp_rank 0 of model {OTHER!r}: live worker 'v0'" in refused.reason
    # model MODEL's group dp1 dies: OTHER's group dp1 (v1) still routes
    h.core.peer_gone(b"w1", h.now)
    h.out()
    assert sorted(w.worker_id for w in h.core.admission.routable()) == ["v0", "v1", "w0"]


def test_a_request_runs_on_the_workers_of_the_model_it_names():
    h = two_models()
    out = []
    for i in range(6):
        out += h.submit(C1, f"m{i}", model=MODEL)
        out += h.submit(C1, f"o{i}", model=OTHER)
    where = routed(out)
    assert all(where[f"m{i}"] in (["w0"], ["w1"]) for i in range(6))
    assert {w for i in range(6) for w in where[f"m{i}"]} == {"w0", "w1"}  # spread over MODEL's two
    assert all(where[f"o{i}"] == ["v0"] for i in range(6))
    # a failover stays on its model: v0 dies, OTHER's requests wait for a worker of OTHER, never go to w0 / w1
    h.core.peer_gone(b"v0", h.now)
    assert not routed(h.out())
    assert len(h.core.requests.held) == 6
    out = h.send(b"v1", worker_hello("v1", None, model=OTHER))
    assert sorted(routed(out)) == [f"o{i}" for i in range(6)] and {w for ws in routed(out).values() for w in ws} == {
        "v1"
    }


def test_an_unknown_model_is_refused_naming_what_is_served():
    h = two_models()
    (error,) = of_type(h.submit(C1, "r1", model="gpt-9"), Error, C1)
    assert error.code == "model_not_found" and error.request_id == "r1"
    assert "the model 'gpt-9' is not served here; it serves 'other-model', 'tiny-model'" in error.message
    assert "the LoRA adapters 'sql' (on 'other-model')" in error.message
    assert not h.core.requests.by_id  # nothing kept


def test_no_model_named_on_several_models_without_a_default_is_refused_with_the_list():
    h = two_models()
    (error,) = of_type(h.submit(C1, "r1"), Error, C1)
    assert error.code == "invalid_request"
    assert "names no model and this cluster serves several ('other-model', 'tiny-model')" in error.message
    assert "--model-id" in error.message


def test_model_id_pins_the_models_and_its_first_is_the_default():
    h = Harness(model_id=f"{OTHER},{MODEL}")
    h.worker("w0", 0)
    h.send(b"v0", worker_hello("v0", 0, model=OTHER))
    (refused,) = of_type(h.send(b"x0", worker_hello("x0", 0, model="third")), Refused)
    assert refused.reason == (
        f"model id differs: the cluster serves {OTHER!r}, {MODEL!r} (from --model-id), worker 'x0' has 'third'"
    )
    assert routed(h.submit(C1, "r1")) == {"r1": ["v0"]}  # no model named: the default, --model-id's first
    assert routed(h.submit(C1, "r2", model=MODEL)) == {"r2": ["w0"]}
    (welcome,) = of_type(h.send(C1, Hello(role="client", peer_id="c")), Welcome)
    assert welcome.model_id == OTHER


def test_one_model_and_no_model_named_works_as_before():
    h = Harness()
    h.worker("w0", 0)
    assert routed(h.submit(C1, "r1")) == {"r1": ["w0"]}
    assert routed(h.submit(C1, "r2", model=MODEL)) == {"r2": ["w0"]}
    # a request before any worker waits for the first, whatever its model
    h = Harness()
    assert not routed(h.submit(C1, "r1"))
    assert routed(h.send(b"v0", worker_hello("v0", 0, model=OTHER))) == {"r1": ["v0"]}


def test_an_adapter_named_as_the_model_runs_on_its_base_models_workers():
    h = two_models()
    out = h.submit(C1, "r1", model="sql")
    (dispatch,) = dispatches(out)[b"v0"]
    assert dispatch.spec.sampling.lora_name == "sql"
    # the adapter in lora_name and no model: its base too
    (dispatch,) = dispatches(h.submit(C1, "r2", lora_name="sql"))[b"v0"]
    assert dispatch.spec.sampling.lora_name == "sql"


def test_a_known_model_without_a_worker_waits_and_holds_up_no_other_model():
    h = Harness(model_id=f"{MODEL},{OTHER}", queue_timeout=0.3)
    h.worker("w0", 0)
    assert not routed(h.submit(C1, "o1", model=OTHER))  # served (pinned), no worker yet: held
    assert routed(h.submit(C1, "m1", model=MODEL)) == {"m1": ["w0"]}  # not behind o1
    h.step("w0", delta("m1", 5, finish="stop"))
    out = h.advance(0.5)  # past the queue timeout
    (final,) = [d for d in client_deltas(out, C1) if d.request_id == "o1"]
    assert final.finish_reason == "error" and final.error_code == "unavailable"


def test_stats_are_per_model():
    h = two_models(model_id=f"{MODEL},{OTHER}")
    h.submit(C1, "m1", model=MODEL)
    h.submit(C1, "m2", model=MODEL)
    h.submit(C1, "o1", model="sql")
    h.step("w0" if "m1" in h.core.workers.by_id["w0"].requests else "w1", delta("m1", 5, finish="stop"))
    (stats,) = of_type(h.send(C1, StatsRequest()), ClusterStats, C1)
    assert {w.worker_id: w.model_id for w in stats.workers} == {"w0": MODEL, "v0": OTHER, "w1": MODEL}
    mine, other = stats.models
    assert (mine.model_id, mine.default, mine.num_workers, mine.num_healthy_workers) == (MODEL, True, 2, 2)
    assert (mine.requests_submitted, mine.requests_completed, mine.num_in_flight) == (2, 1, 1)
    assert (other.model_id, other.default, other.num_workers, other.requests_submitted) == (OTHER, False, 1, 1)
    assert other.lora_adapters == {"sql": "/adapters/sql"} and mine.lora_adapters == {}
    assert stats.model(OTHER) == other and stats.model("nope") is None


def test_a_models_stats_carry_where_its_workers_read_its_tokenizer():
    """ModelStats.tokenizers: the workers' Hello.tokenizer, distinct, healthy and low ranks first; nothing on the wire
    for workers that send none (a model named by its path)."""
    h = Harness()
    h.worker("w0", 0)
    for wid, rank, source in [("v1", 1, "/b/qwen"), ("v0", 0, "/a/qwen"), ("v2", 2, "/a/qwen"), ("v3", 3, "/c/qwen")]:
        h.send(wid.encode(), worker_hello(wid, rank, model=OTHER, tokenizer=source))
    h.core.peer_gone(b"v0", h.now)
    h.out()
    (stats,) = of_type(h.send(C1, StatsRequest()), ClusterStats, C1)
    assert stats.model(OTHER).tokenizers == ["/b/qwen", "/a/qwen", "/c/qwen"]  # healthy first: v0 is gone
    assert stats.model(MODEL).tokenizers == []
    assert b"tokenizers" not in encode(stats.model(MODEL))  # a model without sources sends no new field
    many = [("x%d" % i, i, f"/m/{i}") for i in range(MAX_TOKENIZER_SOURCES + 3)]
    for wid, rank, source in many:
        h.send(wid.encode(), worker_hello(wid, rank, model="many", tokenizer=source))
    (stats,) = of_type(h.send(C1, StatsRequest()), ClusterStats, C1)
    assert stats.model("many").tokenizers == [f"/m/{i}" for i in range(MAX_TOKENIZER_SOURCES)]
    assert decode(encode(stats)).model("many").tokenizers == stats.model("many").tokenizers


def test_a_lora_load_goes_to_the_workers_of_its_base_model():
    h = two_models()
    load = LoraCommand(action="load", lora_name="chat", lora_path="/adapters/chat")
    (error,) = of_type(h.send(ADMIN, load), Error, ADMIN)
    assert "serves several models" in error.message and "name the adapter's base model" in error.message
    (error,) = of_type(h.send(ADMIN, LoraCommand(action="load", lora_name=OTHER, lora_path="/a", model=MODEL)), Error)
    assert "the name is the base model's" in error.message
    out = h.send(ADMIN, LoraCommand(action="load", lora_name="chat", lora_path="/adapters/chat", model=MODEL))
    assert sorted(i for i, m in out if isinstance(m, LoraCommand)) == [b"w0", b"w1"]
    # a worker of the other model that joins later is not given it; one of MODEL is
    h.core.loras.adapters["chat"], h.core.loras.adapter_models["chat"] = "/adapters/chat", MODEL
    assert not of_type(h.send(b"v1", worker_hello("v1", None, model=OTHER)), LoraCommand)
    assert of_type(h.send(b"w2", worker_hello("w2", None)), LoraCommand)

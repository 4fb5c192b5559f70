"""Structured outputs in the engine on a tiny random Llama (SmolLM2's tokenizer): whatever the model prefers,
the output matches the JSON schema (checked with jsonschema), regex, choice or grammar, greedy and sampled, and
stops when the grammar is complete; compiling happens off the step (a request waits, unscheduled, for its
grammar); an invalid spec fails its request alone with xgrammar's reason; a request resumed on another engine
from its delivered tokens continues exactly, its matcher rebuilt from them."""

from __future__ import annotations

import ast
import json
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import jsonschema
import pytest
from structured_cases import MAX_TOKENS, SCHEMAS

from infer import SamplingParams
from infer.protocol.structured import StructuredOutputsParams as Spec
from infer.protocol.structured import admits_no_value, grammar_error
from infer.worker.engine.config import EngineConfig
from infer.worker.engine.engine import Engine

PROMPT = [3, 17, 42, 99]


def make_engine(model_dir, seed: int = 0) -> Engine:
    return Engine(
        EngineConfig(
            model=str(model_dir),
            dtype="float32",
            max_model_len=512,
            max_num_seqs=64,
            kv_cache_memory=32 << 20,
            seed=seed,
        )
    )


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return make_engine(tiny_model_dir("llama"))


def run(engine: Engine, params: dict[str, SamplingParams], resumed: dict[str, list[int]] | None = None):
    """All requests in one batch; id -> (token ids, text, finish reason, error)."""
    for rid, p in params.items():
        engine.add_request(rid, PROMPT, p, (resumed or {}).get(rid, ()))
    out = {rid: ([], [], None, None) for rid in params}
    for _ in range(2000):
        if not engine.has_unfinished():
            break
        for delta in engine.step():
            ids, texts, _, _ = out[delta.request_id]
            ids += delta.token_ids
            texts.append(delta.text)
            if delta.finished:
                out[delta.request_id] = (ids, texts, delta.finish_reason, delta.error)
    assert not engine.has_unfinished()
    return {rid: (ids, "".join(texts), reason, error) for rid, (ids, texts, reason, error) in out.items()}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_schema_is_matched_greedy_and_sampled(engine, temperature):
    params = {
        name: SamplingParams(
            temperature=temperature, seed=7, max_tokens=MAX_TOKENS, structured_outputs=Spec(json=schema)
        )
        for name, schema in SCHEMAS.items()
    }
    for name, (_, text, reason, error) in run(engine, params).items():
        assert reason == "stop", (name, reason, error, text)
        jsonschema.validate(json.loads(text), SCHEMAS[name])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_regex_choice_and_grammar_are_matched(engine, temperature):
    specs = {
        "regex": Spec(regex=r"[A-Z]{2}-\d{3}(\.[a-z]{1,4})?"),
        "choice": Spec(choice=["left", "right", 'up "quoted"', "日本"]),
        "grammar": Spec(grammar='root ::= num (op num)? (op num)?\nnum ::= [1-9] [0-9]?\nop ::= "+" | "*" | "-"'),
    }  # json_object: a random model never closes its strings (the HTTP tests run it on the real model)
    params = {
        k: SamplingParams(temperature=temperature, seed=3, max_tokens=MAX_TOKENS, structured_outputs=s)
        for k, s in specs.items()
    }
    out = run(engine, params)
    assert all(reason == "stop" for _, _, reason, _ in out.values()), out
    assert re.fullmatch(r"[A-Z]{2}-\d{3}(\.[a-z]{1,4})?", out["regex"][1])
    assert out["choice"][1] in specs["choice"].choice
    assert set(out["grammar"][1]) <= set("0123456789+*-")
    ast.parse(out["grammar"][1], mode="eval")


def test_a_constrained_request_shares_the_batch_with_free_ones_which_it_does_not_change(engine):
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = run(engine, {"free": free})["free"][0]
    both = run(
        engine,
        {
            "free": free,
            "json": SamplingParams(
                temperature=0, max_tokens=MAX_TOKENS, structured_outputs=Spec(json=SCHEMAS["flat object"])
            ),
        },
    )
    assert both["free"][0] == alone
    jsonschema.validate(json.loads(both["json"][1]), SCHEMAS["flat object"])


@pytest.mark.parametrize(
    "spec, reason",
    [
        (Spec(regex="a(b"), "The parenthesis is not closed"),
        (Spec(json='{"type": 5}'), "Type should be a string"),
        (Spec(grammar="root ::= nothing"), 'Rule "nothing" is not defined'),
        (Spec(grammar="root ::= a\na ::= root"), "admits no output"),
        (Spec(json='{"$ref": "#"}'), "admits no output"),
    ],
)
def test_an_invalid_spec_fails_its_request_alone_as_invalid(engine, spec, reason):
    out = run(
        engine,
        {
            "bad": SamplingParams(max_tokens=4, structured_outputs=spec),
            "good": SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
        },
    )
    _, _, finish, error = out["bad"]
    assert finish == "error" and error.startswith("structured_outputs: ") and reason in error
    assert out["good"][2] == "length"


def test_a_request_waits_unscheduled_while_its_grammar_compiles(engine):
    params = SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, structured_outputs=Spec(json={**SCHEMAS["mixed"], "title": "fresh"})
    )
    request = engine.add_request("compiling", PROMPT, params)
    assert engine.scheduler.get("compiling") is None and engine.has_unfinished()
    assert engine.load().num_waiting == 1
    assert engine.abort("compiling")  # an abort while compiling ends it at once
    [final] = engine.step()
    assert final.finish_reason == "abort" and request.status.value == "abort" and not engine.has_unfinished()


@pytest.mark.parametrize(
    "schema, loop",
    [
        ({"$ref": "#"}, "# -> #"),
        (
            {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b", "title": "A"}, "b": {"$ref": "#/$defs/a"}}},
            "#/$defs/a -> #/$defs/b -> #/$defs/a",
        ),
        ({"$ref": "#/definitions/x~1y", "definitions": {"x/y": {"$ref": "#"}}}, "# -> #/definitions/x~1y -> #"),
    ],
)
def test_a_schema_that_only_refers_to_itself_admits_no_output_in_our_words(schema, loop):
    reason = admits_no_value(Spec(json=schema))
    assert reason == f"admits no output: its $ref chain {loop} comes back to where it began without a schema"
    assert grammar_error(Spec(json=schema)) == reason  # the HTTP front's check says the same


@pytest.mark.parametrize(
    "schema",
    [
        {"$ref": "#/$defs/a", "$defs": {"a": {"type": "string"}}},
        {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#", "type": "object"}}},  # content beside the $ref
        {"type": "object", "properties": {"next": {"$ref": "#"}}},  # recursive, with content: a linked list
        {"$ref": "#/$defs/missing"},  # resolves nowhere: xgrammar's to name
    ],
)
def test_a_schema_with_content_or_an_unresolved_ref_is_not_ours_to_refuse(schema):
    assert admits_no_value(Spec(json=schema)) is None


@contextmanager
def held_compiles(
    monkeypatch, title: str, release_after_s: float = 60.0, order: list[str] | None = None
) -> Iterator[threading.Event]:
    """Hold the compile thread on every JSON schema whose title starts with `title` until the block ends (or
    `release_after_s`, or the event yielded is set): a compile slow by construction, not by a schema that happens
    to be slow to compile in one xgrammar version. `order` gets each compile's title (its kind when it has none)
    as the thread takes it up."""
    from infer.worker.engine.structured import GrammarCompilerPool

    compile_spec, release = GrammarCompilerPool._compile_spec, threading.Event()

    def held(pool, spec):
        label = str(json.loads(spec.json).get("title", "")) if spec.json is not None else spec.kind
        if order is not None:
            order.append(label)
        if label.startswith(title):
            release.wait(release_after_s)
        return compile_spec(pool, spec)

    monkeypatch.setattr(GrammarCompilerPool, "_compile_spec", held)
    try:
        yield release
    finally:
        release.set()


def test_a_grammar_that_does_not_compile_in_time_fails_its_request_and_the_engine_goes_on(engine, monkeypatch):
    import infer.worker.engine.grammar_queue as grammar_queue

    monkeypatch.setattr(grammar_queue, "COMPILE_TIMEOUT_S", 0.05)
    slow = Spec(json={"type": "string", "title": "slow to compile"})
    with held_compiles(monkeypatch, "slow"):
        out = run(
            engine,
            {
                "slow": SamplingParams(max_tokens=4, structured_outputs=slow),
                "free": SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
            },
        )
    assert out["slow"][2] == "error" and "did not compile within 0.05 s" in out["slow"][3]
    assert out["free"][2] == "length"


def test_time_queued_behind_other_compiles_does_not_count_against_a_compile(tiny_model_dir, monkeypatch):
    """A grammar queued behind a compile that takes 1.5 s, with a 0.5 s compile bound: the blocker fails, the one
    queued behind it (1.5 s queued, then quick to compile) is served."""
    import infer.worker.engine.grammar_queue as grammar_queue

    engine = make_engine(tiny_model_dir("llama"))
    monkeypatch.setattr(grammar_queue, "COMPILE_TIMEOUT_S", 0.5)
    with held_compiles(monkeypatch, "blocker", release_after_s=1.5):
        out = run(
            engine,
            {
                "blocker": SamplingParams(
                    max_tokens=4, structured_outputs=Spec(json={"type": "string", "title": "blocker"})
                ),
                "queued": SamplingParams(
                    temperature=0,
                    max_tokens=MAX_TOKENS,
                    structured_outputs=Spec(json={**SCHEMAS["mixed"], "title": "q"}),
                ),
            },
        )
    assert out["blocker"][2] == "error" and "did not compile within 0.5 s" in out["blocker"][3]
    assert out["queued"][2] in ("stop", "length") and out["queued"][3] is None, out["queued"]


def test_a_request_queued_past_the_wait_bound_fails_as_overloaded(tiny_model_dir, monkeypatch):
    import infer.worker.engine.grammar_queue as grammar_queue

    engine = make_engine(tiny_model_dir("llama"))
    monkeypatch.setattr(grammar_queue, "COMPILE_WAIT_TIMEOUT_S", 0.5)
    with held_compiles(monkeypatch, "blocker", release_after_s=1.5):
        for rid, title in (("blocker", "blocker"), ("queued", "q")):
            engine.add_request(
                rid, PROMPT, SamplingParams(max_tokens=4, structured_outputs=Spec(json={"title": title}))
            )
        finals = {}
        while engine.has_unfinished():
            finals.update({d.request_id: d for d in engine.step() if d.finished})
    queued = finals["queued"]
    assert queued.finish_reason == "error" and "not ready within 0.5 s" in queued.error
    assert queued.error_code == "overloaded"


def test_a_resumed_request_rebuilds_its_matcher_from_the_delivered_tokens(tiny_model_dir, engine):
    schema = SCHEMAS["array of objects"]
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=MAX_TOKENS, structured_outputs=Spec(json=schema))
    ids, text, reason, _ = run(engine, {"whole": params})["whole"]
    assert reason == "stop" and len(ids) > 6
    other = make_engine(tiny_model_dir("llama"), seed=99)
    for k in (1, len(ids) // 2, len(ids) - 1):
        tail, _, reason, _ = run(other, {f"cut{k}": params}, {f"cut{k}": ids[:k]})[f"cut{k}"]
        assert ids[:k] + tail == ids and reason == "stop"
    bad = run(other, {"bad": params}, {"bad": [PROMPT[0]] * 3})["bad"]
    assert bad[2] == "error" and "does not match the grammar" in bad[3]


# ---- bounds on a grammar's work (worker/engine/structured.py) ----------------------------------------------------------

COSTLY_REGEX = r"([\s\S]{0,100}){0,100}"  # compiles in 1 s, a cheap first mask, then masks of seconds a token


def finals(
    engine: Engine, requests: dict[str, tuple[SamplingParams, str | None]], release: threading.Event | None = None
) -> dict:
    """Add every request (params, client) at once, set `release` (held compiles go on), step until all end;
    id -> its final delta."""
    for rid, (params, client) in requests.items():
        engine.add_request(rid, PROMPT, params, client=client)
    if release is not None:
        release.set()
    out = {}
    for _ in range(2000):
        if not engine.has_unfinished():
            break
        out.update((d.request_id, d) for d in engine.step() if d.finished)
    assert not engine.has_unfinished() and set(out) == set(requests)
    return out


def test_a_grammar_too_costly_to_follow_fails_alone_and_a_plain_request_beside_it_completes(engine):
    out = finals(
        engine,
        {
            "costly": (
                SamplingParams(temperature=1.0, seed=1, max_tokens=64, structured_outputs=Spec(regex=COSTLY_REGEX)),
                None,
            ),
            "plain": (SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), None),
        },
    )
    costly = out["costly"]
    assert costly.finish_reason == "error" and costly.error_code == "invalid_request", costly
    assert (
        costly.error.startswith("structured_outputs: the grammar is too costly to follow")
        and "--max-grammar-step-ms" in costly.error
    ), costly.error
    assert out["plain"].finish_reason == "length"


def test_a_grammar_whose_first_mask_costs_more_than_a_step_is_refused_before_it_runs(tiny_model_dir):
    engine = Engine(
        EngineConfig(
            model=str(tiny_model_dir("llama")),
            dtype="float32",
            max_model_len=512,
            kv_cache_memory=32 << 20,
            max_grammar_step_ms=0.001,
        )
    )  # every mask costs more
    spec = Spec(regex=r"[A-Z]{2}-\d{3}")
    out = finals(
        engine,
        {
            "costly": (SamplingParams(max_tokens=8, structured_outputs=spec), None),
            "plain": (SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), None),
        },
    )
    costly = out["costly"]
    assert costly.error_code == "invalid_request" and costly.token_ids == [] and costly.queue_time_s is None
    assert "too costly to follow" in costly.error and "for its first token" in costly.error, costly.error
    assert out["plain"].finish_reason == "length"
    again = finals(engine, {"again": (SamplingParams(max_tokens=8, structured_outputs=spec), None)})["again"]
    assert again.error == costly.error  # judged once: the refusal is cached with the spec


def slow_schema(i: object) -> Spec:
    """A distinct JSON schema whose compile `held_compiles(monkeypatch, "held")` holds."""
    return Spec(json={"type": "string", "title": f"held {i}"})


def test_compiles_past_the_engine_and_client_bounds_are_refused_as_overloaded_at_once(tiny_model_dir, monkeypatch):
    engine = Engine(
        EngineConfig(
            model=str(tiny_model_dir("llama")),
            dtype="float32",
            max_model_len=512,
            kv_cache_memory=32 << 20,
            max_grammar_compiles=3,
            max_grammar_compiles_per_client=2,
        )
    )

    def params(spec: Spec) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=4, structured_outputs=spec)

    requests = {f"a{i}": (params(slow_schema(i)), "a") for i in range(3)}  # a2: past a's bound of 2
    requests |= {f"b{i}": (params(slow_schema(10 + i)), "b") for i in range(3)}  # b1, b2: past the engine's 3
    requests["a0 again"] = (params(slow_schema(0)), "a")  # the same spec as a0 compiling: no place taken
    requests["b0 again"] = (params(slow_schema(10)), None)
    with held_compiles(monkeypatch, "held") as release:  # all still compiling when the last one comes
        out = finals(engine, requests, release)
    refused = {rid: d for rid, d in out.items() if d.error_code == "overloaded"}
    assert set(refused) == {"a2", "b1", "b2"}, {rid: d.error for rid, d in out.items()}
    assert "--max-grammar-compiles-per-client 2" in refused["a2"].error
    assert all("--max-grammar-compiles 3" in refused[rid].error for rid in ("b1", "b2"))
    assert all(d.queue_time_s == 0.0 and d.token_ids == [] for d in refused.values())  # the client hears it
    assert all(d.finish_reason == "length" for rid, d in out.items() if rid not in refused)

    burst = {f"c{i}": (params(slow_schema(20 + i)), f"c{i}") for i in range(3)}  # the engine's bound, full
    burst["cached"] = (params(slow_schema(0)), "c0")  # compiled before: it waits behind none of them
    with held_compiles(monkeypatch, "held") as release:
        out = finals(engine, burst, release)
    assert all(d.finish_reason == "length" for d in out.values()), {rid: d.error for rid, d in out.items()}


def test_the_compile_thread_takes_turns_between_clients(tiny_model_dir, monkeypatch):
    """Client a queues three compiles, then b one, while the thread is held on another client's: b's compile runs
    after a0's only, not after a's whole backlog."""
    engine = make_engine(tiny_model_dir("llama"))
    params = {"gate": slow_schema("gate")} | {f"a{i}": slow_schema(30 + i) for i in range(3)}
    requests = {
        rid: (SamplingParams(temperature=0, max_tokens=4, structured_outputs=spec), rid[0])
        for rid, spec in params.items()
    }
    requests["b"] = (SamplingParams(temperature=0, max_tokens=4, structured_outputs=Spec(regex=r"[a-z]{1,3}")), "b")
    order: list[str] = []
    with held_compiles(monkeypatch, "held gate", order=order) as release:
        out = finals(engine, requests, release)
    assert order == ["held gate", "held 30", "regex", "held 31", "held 32"]
    assert all(d.finish_reason in ("stop", "length") for d in out.values()), {rid: d.error for rid, d in out.items()}

"""LoRA adapters (worker/engine/lora.py): adapters made with PEFT on tiny random models; greedy output of each request equals
transformers + PEFT with its adapter, with several adapters and the base model mixed in one batch; slots, eviction,
load / unload, the prefix cache keyed by adapter, bad adapters refused by name."""

from __future__ import annotations

import dataclasses
import json
import math
import random

import pytest
import torch
from lora_cases import ADAPTERS, make_adapter, peft_greedy

from infer import SamplingParams
from infer.protocol.lora import LoRARequest, lora_modules, parse_lora_module, read_lora_config
from infer.worker.engine.config import EngineConfig
from infer.worker.engine.engine import Engine
from infer.worker.engine.lora import STACKED_MAX_ROWS, LoraLayer, LoraManager, lora_step, slot_runs
from infer.worker.engine.lora_slots import LoraSlots
from infer.worker.models.layers import MergedColumnLinear

MAX_NEW = 8


@pytest.fixture(scope="module")
def families(tiny_model_dir, tmp_path_factory):
    """Factory: arch -> (model dir, {adapter name: folder}) for a tiny model family (qwen2: biases on q, k, v)."""
    made = {}

    def make(arch: str):
        if arch not in made:
            model_dir, folders = tiny_model_dir(arch), {}
            for i, (name, options) in enumerate(ADAPTERS.items()):
                folders[name] = tmp_path_factory.mktemp(f"lora-{arch}-{name}")
                make_adapter(model_dir, folders[name], 100 + i, **options)
            made[arch] = model_dir, folders
        return made[arch]

    return make


@pytest.fixture(scope="module")
def family(families):
    return families("llama")


def _prompts(n: int, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49000) for _ in range(rng.randrange(3, 40))] for _ in range(n)]


def _swap_kernels(monkeypatch, engine: Engine, **ops) -> None:
    """Give the engine's model layers their device's kernel table (kernels/dispatch.py) with `ops` replaced; the
    LoRA layers made from then on take it from their linears."""
    for module in engine.model.modules():
        if (kernels := getattr(module, "kernels", None)) is not None:
            monkeypatch.setattr(module, "kernels", dataclasses.replace(kernels, **ops))


def _engine(model_dir, folders, **options) -> Engine:
    defaults = dict(
        model=str(model_dir),
        dtype="float32",
        max_model_len=256,
        kv_cache_memory=8 << 20,
        block_size=4,
        enable_lora=True,
        max_loras=4,
        max_lora_rank=8,
        lora_modules=folders,
    )
    return Engine(EngineConfig(**{**defaults, **options}))


def _run(engine: Engine, requests: dict[str, tuple[list[int], str | None]]) -> dict[str, list[int]]:
    for rid, (prompt, lora) in requests.items():
        engine.add_request(
            rid, prompt, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, lora_name=lora)
        )
    out: dict[str, list[int]] = {rid: [] for rid in requests}
    while engine.has_unfinished():
        for delta in engine.step():
            assert delta.error is None, delta.error
            out[delta.request_id].extend(delta.token_ids)
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_mixed_batch_equals_transformers_and_peft(families, arch):
    model_dir, folders = families(arch)
    prompts = _prompts(5)
    adapters = [None, *folders]  # each prompt with the base model and with every adapter, in one batch
    expected = {name: peft_greedy(model_dir, folders.get(name), prompts, MAX_NEW) for name in adapters}
    assert all(expected[name] != expected[None] for name in folders), "an adapter that changes nothing proves nothing"
    engine = _engine(model_dir, folders)
    requests = {f"{name}-{i}": (p, name) for i, p in enumerate(prompts) for name in adapters}
    got = _run(engine, requests)
    for name in adapters:
        assert [got[f"{name}-{i}"] for i in range(len(prompts))] == expected[name], name
    # every targeted layer got its slot stacks (qkv_proj, o_proj, gate_up_proj, down_proj of both layers)
    assert len(engine.lora.slots.placed) == 3 and len(engine.lora.layers) == 4 * 2


def test_cpu_steps_take_the_native_kernel_and_the_twin_gives_the_same_tokens(family, monkeypatch):
    """On a CPU with the native kernels every LoraLayer.apply of a step of few rows is one call to kernels/cpu/lora.c
    (each forward with adapter rows: one call per targeted layer); the torch twin, forced, gives the same tokens, and
    both equal transformers + PEFT."""
    from infer.kernels.cpu_kernels import lora_rows, native_ready

    if not native_ready():
        pytest.skip("no native CPU kernels (no C compiler, or INFER_CPU_KERNELS=0)")
    model_dir, folders = family
    prompts = _prompts(3, seed=21)
    requests = {f"{name}-{i}": (p, name) for i, p in enumerate(prompts) for name in (None, *folders)}
    calls: list[int] = []

    def counted(x, y, slots, *rest):
        calls.append(int((slots >= 0).sum()))
        return lora_rows(x, y, slots, *rest)

    engine = _engine(model_dir, folders)
    _swap_kernels(monkeypatch, engine, lora_rows=counted)
    got = _run(engine, requests)
    layers = len(engine.lora.layers)
    assert calls and len(calls) % layers == 0 and all(n > 0 for n in calls)
    assert max(calls) == len(folders) * len(prompts), "a decode step of every adapter's rows in one call a layer"
    calls.clear()
    engine = _engine(model_dir, folders)
    _swap_kernels(monkeypatch, engine, lora_rows=counted, lora_rows_takes=lambda *args: False)
    assert _run(engine, requests) == got and not calls
    for name in (None, *folders):
        expected = peft_greedy(model_dir, folders.get(name), prompts, MAX_NEW)
        assert [got[f"{name}-{i}"] for i in range(len(prompts))] == expected, name


def test_slots_evict_least_recently_used_and_bound_the_running_adapters(family):
    model_dir, folders = family
    prompts = _prompts(3, seed=5)
    expected = {name: peft_greedy(model_dir, folders[name], prompts, MAX_NEW) for name in folders}
    engine = _engine(model_dir, folders, max_loras=2)  # three adapters, two slots
    requests = {f"{name}-{i}": (p, name) for i, p in enumerate(prompts) for name in folders}
    max_running = 0
    for rid, (prompt, lora) in requests.items():
        engine.add_request(
            rid, prompt, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, lora_name=lora)
        )
    got: dict[str, list[int]] = {rid: [] for rid in requests}
    while engine.has_unfinished():
        for delta in engine.step():
            got[delta.request_id].extend(delta.token_ids)
        max_running = max(max_running, len(engine.scheduler.running_lora_ids()))
        engine.lora.slots.check_invariants()
    assert max_running == 2
    for name in folders:
        assert [got[f"{name}-{i}"] for i in range(len(prompts))] == expected[name], name


def test_prefix_cache_is_keyed_by_adapter(family):
    model_dir, folders = family
    prompt = _prompts(1, seed=9)[0] * 3  # several full blocks
    engine = _engine(model_dir, folders)
    first = _run(engine, {"base": (prompt, None)})["base"]
    hits = engine.scheduler.block_manager.num_hit_tokens
    with_adapter = _run(engine, {"qv": (prompt, "qv")})["qv"]
    assert engine.scheduler.block_manager.num_hit_tokens == hits  # the base model's blocks are not the adapter's
    assert with_adapter == peft_greedy(model_dir, folders["qv"], [prompt], MAX_NEW)[0]
    assert _run(engine, {"qv2": (prompt, "qv")})["qv2"] == with_adapter
    assert engine.scheduler.block_manager.num_hit_tokens > hits  # the same adapter's blocks are
    hits = engine.scheduler.block_manager.num_hit_tokens
    _run(engine, {"mlp": (prompt, "mlp")})
    assert engine.scheduler.block_manager.num_hit_tokens == hits
    assert _run(engine, {"base2": (prompt, None)})["base2"] == first


def test_load_and_unload_while_requests_run(family, tmp_path):
    model_dir, folders = family
    prompts = _prompts(3, seed=11)
    expected = peft_greedy(model_dir, folders["qv"], prompts, MAX_NEW)
    engine = _engine(model_dir, {})
    assert engine.list_loras() == []
    engine.add_lora("qv", str(folders["qv"]))
    for i, p in enumerate(prompts):
        engine.add_request(
            f"r{i}", p, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, lora_name="qv")
        )
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    for delta in engine.step() + engine.step():
        got[delta.request_id].extend(delta.token_ids)
    assert engine.remove_lora("qv") is True  # running requests keep their adapter to the end
    with pytest.raises(ValueError, match="unknown LoRA adapter 'qv'"):
        engine.add_request("late", prompts[0], SamplingParams(lora_name="qv"))
    engine.add_lora("mlp", str(folders["mlp"]))  # loaded while they run
    while engine.has_unfinished():
        for delta in engine.step():
            got[delta.request_id].extend(delta.token_ids)
    assert [got[f"r{i}"] for i in range(len(prompts))] == expected
    assert [a["name"] for a in engine.list_loras()] == ["mlp"]
    assert len(engine.lora.by_id) == 1  # the unloaded adapter's weights went with its last request
    engine.add_lora("qv", str(folders["qv"]))  # and it loads again
    assert _run(engine, {"again": (prompts[0], "qv")})["again"] == expected[0]


def _copy_adapter(src, dst, edit_config=None, drop_weights=False):
    dst.mkdir()
    config = json.loads((src / "adapter_config.json").read_text())
    if edit_config:
        config.update(edit_config)
    (dst / "adapter_config.json").write_text(json.dumps(config))
    if not drop_weights:
        (dst / "adapter_model.safetensors").write_bytes((src / "adapter_model.safetensors").read_bytes())
    return dst


def test_bad_adapters_are_refused_by_name_and_the_engine_keeps_serving(family, tmp_path):
    model_dir, folders = family
    engine = _engine(model_dir, {"qv": folders["qv"]}, max_lora_rank=4)
    cases = {
        "missing": (tmp_path / "nowhere", "adapter_config.json: no such file"),
        "no-weights": (
            _copy_adapter(folders["qv"], tmp_path / "a", drop_weights=True),
            "adapter_model.safetensors: no such file",
        ),
        "dora": (_copy_adapter(folders["qv"], tmp_path / "b", {"use_dora": True}), "DoRA"),
        "saved": (_copy_adapter(folders["qv"], tmp_path / "c", {"modules_to_save": ["lm_head"]}), "modules_to_save"),
        "rank": (folders["all-rs"], r"rank 8, above --max-lora-rank 4"),
    }
    for name, (path, message) in cases.items():
        with pytest.raises(ValueError, match=message):
            engine.add_lora(name, str(path))
    with pytest.raises(ValueError, match="already loaded"):
        engine.add_lora("qv", str(folders["mlp"]))
    with pytest.raises(ValueError, match=r"unknown LoRA adapter 'nope' \(loaded: qv\)"):
        engine.add_request("x", [5, 6, 7], SamplingParams(lora_name="nope"))
    prompt = _prompts(1)[0]
    assert _run(engine, {"ok": (prompt, "qv")})["ok"] == peft_greedy(model_dir, folders["qv"], [prompt], MAX_NEW)[0]


def test_lora_off_refuses_adapter_requests(tiny_model_dir):
    engine = Engine(
        EngineConfig(model=str(tiny_model_dir("llama")), dtype="float32", max_model_len=128, kv_cache_memory=4 << 20)
    )
    with pytest.raises(ValueError, match="not enabled"):
        engine.add_request("x", [5, 6], SamplingParams(lora_name="a"))
    with pytest.raises(ValueError, match="not enabled"):
        engine.add_lora("a", "/nowhere")
    assert engine.lora is None and engine.list_loras() == []


def test_lora_slots_lru():
    slots = LoraSlots(2)
    assert slots.place([1, 2], in_use=set()) == [(1, 0), (2, 1)]
    assert slots.place([1], in_use=set()) == []  # 2 is now the least recently used
    assert slots.place([3], in_use=set()) == [(3, 1)]  # evicts 2
    with pytest.raises(RuntimeError, match="in use"):
        slots.place([4], in_use={1, 3})
    assert slots.place([4], in_use={3}) == [(4, 0)]
    assert slots.drop(3) == 1 and slots.placed == (4,)
    slots.check_invariants()


def _runs(*runs: tuple[int, int]) -> list[tuple[int, int]]:
    return list(runs)


# (slot, rows) runs of a forward (-1: the base model) and the path LoraManager.step gives them
LAYOUTS = {
    "stacked, equal groups": (_runs((0, 1), (1, 1), (2, 1), (3, 1), (0, 1), (1, 1), (2, 1), (3, 1)), "stacked"),
    "stacked, padded, a slot unused between": (_runs((-1, 2), (3, 3), (1, 1), (-1, 1), (1, 1)), "stacked"),
    "prefills as slices": (_runs((-1, 30), (2, 40), (0, 25), (2, 5)), "slices"),
    "interleaved decodes: gathered groups": (_runs(*[(i % 3, 1) for i in range(20)], (1, 50), (-1, 10)), "gathered"),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_rows_delta_is_its_own_adapters_on_every_path(layout):
    """LoraLayer.apply on a fused layer (sub-blocks of ranks 3 and 4 under max rank 4) equals, row by row, the
    base output plus (x A^T) B^T of the row's slot, whichever path the step's layout takes."""
    slot_rows, path = LAYOUTS[layout]
    gen = torch.Generator().manual_seed(5)
    linear = MergedColumnLinear(16, {"q": 12, "k": 8, "v": 8}, False, torch.float32)
    layer = LoraLayer(linear, num_slots=4, max_rank=4, dtype=torch.float32, device=torch.device("cpu"))
    pairs = {}
    for slot in range(4):
        for shard, rows, rank in (("q", 12, 4), ("k", 8, 3), ("v", 8, 4)):
            pairs[slot, shard] = torch.randn(rank, 16, generator=gen), torch.randn(rows, rank, generator=gen)
            layer.fill(slot, shard, *pairs[slot, shard])
    manager = LoraManager(
        torch.nn.Module(), max_loras=4, max_lora_rank=4, dtype=torch.float32, device=torch.device("cpu")
    )
    step = manager.step(slot_rows)
    assert step is not None
    taken = (
        "stacked"
        if step.stacked is not None
        else ("slices" if all(isinstance(rows, slice) for _, rows in step.groups) else "gathered")
    )
    assert taken == path
    total = sum(n for _, n in slot_rows)
    assert (total <= STACKED_MAX_ROWS) == (path == "stacked")
    x = torch.randn(total, 16, generator=gen)
    base = torch.randn(total, 28, generator=gen)
    with lora_step(step):
        got = layer.apply(x, base.clone())
    expected = base.clone()
    row = 0
    for slot, n in slot_rows:
        for r in range(row, row + n):
            if slot >= 0:
                expected[r] += torch.cat([(x[r] @ a.T) @ b.T for a, b in (pairs[slot, s] for s in "qkv")])
        row += n
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_slot_runs_merge_neighbours_of_one_slot_and_skip_base_rows():
    assert slot_runs([(-1, 2), (1, 3), (1, 1), (-1, 1), (1, 2), (0, 0), (2, 1)]) == [(1, 2, 6), (1, 7, 9), (2, 9, 10)]
    assert slot_runs([(-1, 5)]) == []


def test_options_and_config_parsing(tmp_path):
    assert parse_lora_module("a=/x/y") == ("a", "/x/y")
    assert parse_lora_module('{"name": "b", "path": "/p", "base_model_name": "m"}') == ("b", "/p")
    assert lora_modules({"a": "/p"}) == (("a", "/p"),)
    with pytest.raises(ValueError, match="given twice"):
        lora_modules(["a=/p", "a=/q"])
    with pytest.raises(ValueError, match="name=path"):
        parse_lora_module("nopath")
    with pytest.raises(ValueError, match="lora_name"):
        SamplingParams(lora_name="bad name")
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("a", 0, "/p")
    with pytest.raises(ValueError, match="needs enable_lora"):
        EngineConfig(lora_modules=["a=/p"])
    (tmp_path / "adapter_config.json").write_text(
        json.dumps({"r": 4, "lora_alpha": 16, "use_rslora": True, "target_modules": "q_proj"})
    )
    config = read_lora_config(tmp_path)
    assert config.scaling(4) == 8.0 and config.target_modules == ("q_proj",)
    import argparse

    from infer.protocol.options import add_options, given, to_argv

    parser = argparse.ArgumentParser()
    add_options(parser, EngineConfig)
    args = parser.parse_args(
        ["--enable-lora", "--lora-modules", "a=/p", "b=/q", "--max-loras", "2", "--max-lora-rank", "32"]
    )
    config_ = EngineConfig(**given(EngineConfig, args))
    assert config_.lora_modules == (("a", "/p"), ("b", "/q")) and config_.max_loras == 2
    assert to_argv(EngineConfig, config_) == [
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "32",
        "--lora-modules",
        "a=/p",
        "b=/q",
    ]


def test_llm_generate_takes_lora_requests_per_prompt(family):
    from infer import LLM

    model_dir, folders = family
    prompts = _prompts(3, seed=13)
    qv, mlp = LoRARequest("qv", 1, str(folders["qv"])), LoRARequest("mlp", 2, str(folders["mlp"]))
    llm = LLM(
        str(model_dir), dtype="float32", max_model_len=256, kv_cache_memory=8 << 20, enable_lora=True, max_lora_rank=8
    )
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=[qv, None, mlp])  # loaded on first use
    assert [o.token_ids for o in outs] == [
        peft_greedy(model_dir, folders["qv"], prompts[:1], MAX_NEW)[0],
        peft_greedy(model_dir, None, prompts[1:2], MAX_NEW)[0],
        peft_greedy(model_dir, folders["mlp"], prompts[2:], MAX_NEW)[0],
    ]
    assert llm.list_loras() == {"qv": str(folders["qv"]), "mlp": str(folders["mlp"])}
    assert llm.remove_lora("mlp") == {"qv": str(folders["qv"])}
    with pytest.raises(ValueError, match="no such file"):
        llm.generate(prompts[0], params, use_tqdm=False, lora_request=LoRARequest("gone", 3, "/nowhere"))


async def test_async_llm_has_the_same_lora_verbs(family):
    """AsyncLLM in-process (its engine thread): add_lora / remove_lora / list_loras, the verbs LLM and
    InferenceClient have too, and a request that names a loaded adapter gets its tokens."""
    from infer import AsyncLLM

    model_dir, folders = family
    prompt = _prompts(1, seed=13)[0]
    qv = LoRARequest("qv", 1, str(folders["qv"]))
    options = dict(dtype="float32", max_model_len=256, kv_cache_memory=8 << 20, enable_lora=True, max_lora_rank=8)
    async with AsyncLLM(str(model_dir), **options) as llm:
        assert await llm.list_loras() == {}
        assert await llm.add_lora(qv) == {"qv": str(folders["qv"])}
        params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, lora_name="qv")
        assert (await llm.generate_batch([prompt], params))[0].token_ids == peft_greedy(
            model_dir, folders["qv"], [prompt], MAX_NEW
        )[0]
        with pytest.raises(TypeError, match="add_lora takes a LoRARequest, got str"):
            await llm.engine.add_lora("qv")  # type: ignore[arg-type]
        assert await llm.remove_lora("qv") == {}
        with pytest.raises(ValueError, match="no LoRA adapter 'qv' is loaded"):
            await llm.remove_lora("qv")


def test_over_a_quantized_base_each_row_gets_its_adapter_alone_or_mixed(family):
    """int8 base weights (their matmul differs from transformers' in the last bits): every request's output in a
    mixed batch equals the same request run alone, and the adapters still change it."""
    model_dir, folders = family
    prompts = _prompts(3, seed=17)
    engine = _engine(model_dir, folders, quantization="int8")
    mixed = _run(engine, {f"{name}-{i}": (p, name) for i, p in enumerate(prompts) for name in (None, *folders)})
    for name in (None, *folders):
        for i, p in enumerate(prompts):
            assert _run(engine, {"alone": (p, name)})["alone"] == mixed[f"{name}-{i}"], (name, i)
    assert all(mixed[f"{name}-0"] != mixed["None-0"] for name in folders)


def test_tensor_parallel_ranks_shard_the_adapters_like_their_layers(family):
    """TP 2 (2 KV heads: one per rank): B's rows split with q / k / v / gate / up, A's columns with o / down; every
    request of a mixed batch equals transformers + PEFT."""
    from infer import LLM

    model_dir, folders = family
    prompts = _prompts(4, seed=19)
    names = [None, *folders]
    requests = [None if n is None else LoRARequest(n, i + 1, str(folders[n])) for i, n in enumerate(names)]
    with LLM(
        str(model_dir),
        tensor_parallel_size=2,
        dtype="float32",
        max_model_len=128,
        kv_cache_memory=4_000_000,
        num_threads=1,
        enable_lora=True,
        max_lora_rank=8,
        max_loras=2,
    ) as llm:
        outs = llm.generate(
            prompts,
            SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True),
            use_tqdm=False,
            lora_request=requests,
        )
    for out, prompt, name in zip(outs, prompts, names):
        assert out.token_ids == peft_greedy(model_dir, folders.get(name), [prompt], MAX_NEW)[0], name


def _rewrite_tensors(src, dst, edit) -> None:
    """A copy of adapter `src` in `dst` with its tensors passed through `edit(name, tensor) -> tensor`."""
    from safetensors.torch import load_file, save_file

    _copy_adapter(src, dst, drop_weights=True)
    tensors = {name: edit(name, t) for name, t in load_file(str(src / "adapter_model.safetensors")).items()}
    save_file(tensors, str(dst / "adapter_model.safetensors"))


def test_adapters_are_checked_as_they_will_run(family, tmp_path):
    """The scaled update is bounded (a finite lora_alpha of 1e308, or a huge rsLoRA alpha, made inf / NaN weights
    that loaded and ran), a rank of 0 is named (it was a ZeroDivisionError), the base model's name is taken, and a
    sane adapter at the edge of the bound still loads."""
    model_dir, folders = family
    engine = _engine(model_dir, {})
    cases = {
        "alpha": (_copy_adapter(folders["qv"], tmp_path / "a", {"lora_alpha": 1e308}), r"scale 2.5e\+307.* can reach"),
        "rs": (_copy_adapter(folders["all-rs"], tmp_path / "b", {"lora_alpha": 1e9}), r"can reach [0-9.e+]+ in one"),
        "inf": (_copy_adapter(folders["qv"], tmp_path / "c", {"lora_alpha": "Infinity"}), "must be a finite positive"),
        "rank0": (tmp_path / "d", r"rank \(r\) must be >= 1, got lora_A \(0, 64\)"),
    }
    _rewrite_tensors(folders["qv"], tmp_path / "d", lambda name, t: t[:0] if "lora_A" in name else t[:, :0])
    (tmp_path / "c" / "adapter_config.json").write_text(
        (tmp_path / "c" / "adapter_config.json").read_text().replace('"Infinity"', "Infinity")
    )
    for name, (path, message) in cases.items():
        with pytest.raises(ValueError, match=message):
            engine.add_lora(name, str(path))
    assert engine.list_loras() == []
    # B scaled so that the bound is just under the limit: loads (the bound is what is judged, not alpha alone)
    bound = update_bound_of(folders["qv"])
    config = json.loads((folders["qv"] / "adapter_config.json").read_text())
    edge = _copy_adapter(folders["qv"], tmp_path / "e", {"lora_alpha": config["lora_alpha"] * 60000 / bound})
    engine.add_lora("edge", str(edge))
    over = _copy_adapter(folders["qv"], tmp_path / "f", {"lora_alpha": config["lora_alpha"] * 70000 / bound})
    with pytest.raises(ValueError, match="above 65504"):
        engine.add_lora("over", str(over))


def update_bound_of(folder) -> float:
    """The largest update bound over an adapter's modules, as worker/engine/lora.py judges it."""
    from safetensors.torch import load_file

    from infer.worker.engine.lora import update_bound

    config = read_lora_config(folder)
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    bounds = []
    for name, a in tensors.items():
        if "lora_A" in name:
            b = tensors[name.replace("lora_A", "lora_B")]
            bounds.append(update_bound(a, b, config.scaling(a.shape[0])))
    return max(bounds)


def test_no_adapter_takes_the_base_models_name(family, monkeypatch):
    """The model id (what the engine reports and a front serves by default) is no adapter's name, at start
    (--lora-modules) or at runtime: /v1/models listed it twice and the adapter could not be reached."""
    model_dir, folders = family
    monkeypatch.chdir(model_dir.parent)  # a relative --model: its id is a valid adapter name
    with pytest.raises(ValueError, match=f"'{model_dir.name}' is the base model's name"):
        _engine(model_dir.name, {model_dir.name: folders["qv"]})
    engine = _engine(model_dir.name, {})
    assert engine.model_id == model_dir.name
    with pytest.raises(ValueError, match="is the base model's name: give the adapter another"):
        engine.add_lora(model_dir.name, str(folders["qv"]))
    assert engine.list_loras() == []


def test_an_unloaded_adapter_nothing_holds_is_freed_at_once(family):
    """On an idle engine an unload drops the adapter's weights there and then (they waited for the next forward
    step before, so load / unload cycles with no requests grew the process by the adapter's size each time); one a
    request holds stays until it ends."""
    model_dir, folders = family
    engine = _engine(model_dir, {})
    trims = engine.heap.num_trims
    for _ in range(3):
        engine.add_lora("qv", str(folders["qv"]))
        assert engine.remove_lora("qv") is True
        assert engine.lora.by_id == {} and engine.lora.slots.placed == ()
    assert engine.heap.num_trims == trims + 3  # the freed heap went back each time
    engine.add_lora("qv", str(folders["qv"]))
    engine.add_request("r", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, lora_name="qv"))
    engine.step()
    assert engine.remove_lora("qv") is True and len(engine.lora.by_id) == 1  # held by "r"
    while engine.has_unfinished():
        engine.step()
    assert engine.lora.by_id == {}


def test_a_request_whose_adapter_makes_nan_fails_alone_over_a_quantized_base(family):
    """Non-finite values in one request's rows (its adapter's weights spoiled in memory, past the load checks) reach
    the logits through the quantized layers, so the sampler's check fails that request alone with its reason; the
    base model's request beside it keeps its tokens. Before, the quantized matmul read a NaN row as finite numbers:
    the request ran on with meaningless tokens (issue 43: token 0, flat logprobs) and no error."""
    model_dir, folders = family
    engine = _engine(model_dir, {"qv": folders["qv"]}, quantization="int8")
    prompt = _prompts(1, seed=5)[0]
    base = _run(engine, {"alone": (prompt, None)})["alone"]
    for a, b in engine.lora.by_name["qv"].weights.values():
        b[0, 0] = math.nan  # not in a slot yet: copied in with the request's first step
    engine.add_request("spoiled", prompt, SamplingParams(temperature=0, max_tokens=MAX_NEW, lora_name="qv"))
    engine.add_request("base", prompt, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    finals, tokens = {}, {"spoiled": [], "base": []}
    while engine.has_unfinished():
        for delta in engine.step():
            tokens[delta.request_id] += delta.token_ids
            if delta.finished:
                finals[delta.request_id] = delta
    assert finals["spoiled"].finish_reason == "error" and finals["spoiled"].error_code == "internal"
    assert "non-finite logits" in finals["spoiled"].error and tokens["spoiled"] == []
    assert finals["base"].finish_reason == "length" and tokens["base"] == base

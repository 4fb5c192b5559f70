"""Tensor parallelism below the worker: two real processes in a gloo world each load their shard of a tiny
Llama and a tiny Qwen3-MoE and hold about half of the weight bytes (counted from the loaded tensors), having
read no more than their half from the safetensors files; their forward equals the one-process model; a dead
member turns the next collective into GroupBroken. Sizes that do not split are refused naming both
numbers; ranks from flags, torchrun and Slurm; LLM's tensor_parallel_size in direct mode."""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch
from moe_models import tiny_qwen3_moe
from ports import join_gloo
from two_ranks import run_two_ranks

from infer.worker.distributed.tensor_parallel import TensorParallel
from infer.worker.parallel.tp_group import TpOptions, resolve_ranks

CPU = torch.device("cpu")


def _weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters the model holds (a tied table once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _batch(ids: list[int]):
    from infer.protocol.sampling import SamplingParams
    from infer.worker.engine.model_runner import build_forward_batch
    from infer.worker.engine.request import Request
    from infer.worker.engine.scheduler import ScheduledChunk

    request = Request(
        request_id="r", prompt_token_ids=ids, params=SamplingParams(), token_ids=list(ids), block_table=[0, 1, 2]
    )
    return build_forward_batch([ScheduledChunk(request, 0, len(ids), len(ids))], 16, CPU)


def _rank_main(rank: int, port: int, path: str, scenario: str, results) -> None:
    import torch.distributed as dist

    from infer.worker.distributed.group_sync import GroupBroken
    from infer.worker.engine.forward_batch import KVCache
    from infer.worker.loading import loader

    try:
        join_gloo(rank, 2, port)
        tp = TensorParallel(rank=rank, size=2, group=dist.group.WORLD, cpu_group=dist.group.WORLD)
        if scenario == "member-dies":
            if rank == 1:
                import os

                os._exit(0)
            try:
                tp.all_reduce(torch.ones(4))
                results.put((rank, "no error"))
            except GroupBroken as e:
                results.put((rank, f"broken: {e}"))
            return
        read = []  # elements each FileTensor materialized
        narrow, whole = loader.FileTensor.narrow, loader.FileTensor.read
        loader.FileTensor.narrow = lambda self, *a: read.append((t := narrow(self, *a)).numel()) or t
        loader.FileTensor.read = lambda self: read.append((t := whole(self)).numel()) or t
        model = loader.load_model(Path(path), torch.float32, CPU, tp=tp)
        kv = KVCache.allocate(model.num_layers, 4, 16, model.num_kv_heads, model.head_dim, torch.float32, CPU)
        batch = _batch(list(range(3, 40)))
        with torch.inference_mode():
            logits = model.compute_logits(model(batch, kv)[batch.logits_indices])
        results.put(
            (
                rank,
                {
                    "bytes": _weight_bytes(model),
                    "read": sum(read),
                    "kv_heads": model.num_kv_heads,
                    "logits": None if logits is None else logits.tolist(),
                },
            )
        )
    except BaseException:
        results.put((rank, traceback.format_exc()))


def _spawn(path: Path | str, scenario: str = "load") -> dict[int, object]:
    return run_two_ranks(
        _rank_main,
        lambda rank: (str(path), scenario),
        timeout_s=120,
        answering=(0,) if scenario == "member-dies" else (0, 1),
    )


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory, smollm2_tokenizer) -> Path:
    return tiny_qwen3_moe(tmp_path_factory.mktemp("tp-moe") / "m", tokenizer=smollm2_tokenizer)


@pytest.mark.parametrize("arch", ["llama", "qwen3-moe"])
def test_each_rank_holds_and_reads_half_the_weights_and_the_forward_is_unchanged(arch, tiny_model_dir, qwen3_moe):
    from infer.worker.engine.forward_batch import KVCache
    from infer.worker.loading.loader import load_model

    path = tiny_model_dir("llama") if arch == "llama" else qwen3_moe
    whole = load_model(path, torch.float32, CPU)
    full = _weight_bytes(whole)
    got = _spawn(path)
    for rank in (0, 1):
        assert isinstance(got[rank], dict), got[rank]
        assert 0.49 * full < got[rank]["bytes"] < 0.51 * full, (got[rank]["bytes"], full)  # norms replicated
        assert got[rank]["read"] * 4 < 0.51 * full  # from the files: its shard, never a whole tensor
        assert got[rank]["kv_heads"] == whole.num_kv_heads // 2  # the KV pool per rank holds only its heads
    assert got[1]["logits"] is None  # logits are gathered on TP rank 0 only
    kv = KVCache.allocate(whole.num_layers, 4, 16, whole.num_kv_heads, whole.head_dim, torch.float32, CPU)
    batch = _batch(list(range(3, 40)))
    with torch.inference_mode():
        want = whole.compute_logits(whole(batch, kv)[batch.logits_indices])
    torch.testing.assert_close(torch.tensor(got[0]["logits"]), want, rtol=1e-4, atol=1e-4)
    assert torch.equal(torch.tensor(got[0]["logits"]).argmax(-1), want.argmax(-1))


def test_a_dead_member_breaks_the_next_collective_instead_of_hanging(tiny_model_dir):
    got = _spawn(tiny_model_dir("llama"), "member-dies")
    assert str(got[0]).startswith("broken: TP group all-reduce failed"), got[0]


def test_sizes_that_do_not_split_are_refused_naming_both(tiny_model_dir):
    from transformers import AutoConfig

    from infer.worker.loading.loader import build_model

    config = AutoConfig.from_pretrained(tiny_model_dir("llama"))  # 4 heads, 2 KV heads, vocabulary 49152
    with pytest.raises(ValueError, match=r"the number of attention heads \(4\) does not split across 3 tensor"):
        build_model(config, torch.float32, "meta", tp=TensorParallel(rank=0, size=3))
    config.vocab_size = 49153
    with pytest.raises(ValueError, match=r"the vocabulary size \(49153\) does not split across 2 tensor"):
        build_model(config, torch.float32, "meta", tp=TensorParallel(rank=0, size=2))
    config.vocab_size, config.num_attention_heads, config.num_key_value_heads = 49152, 8, 3
    with pytest.raises(ValueError, match="3 KV heads neither split across nor replicate evenly over 4"):
        build_model(config, torch.float32, "meta", tp=TensorParallel(rank=0, size=4))
    one_kv = TensorParallel(rank=3, size=4)
    assert one_kv.kv_heads(2) == range(1, 2) and one_kv.kv_heads(8) == range(6, 8)


def test_tp_ranks_from_flags_torchrun_and_slurm():
    assert resolve_ranks(2, 1, 1, None, env={}) == (1, None)
    assert resolve_ranks(2, None, 1, None, env={}) == (None, None)  # supervise the group
    assert resolve_ranks(2, None, 2, None, env={"RANK": "3"}) == (1, 1)  # global 3 = ep 1, tp 1
    assert resolve_ranks(2, None, 2, None, env={"SLURM_PROCID": "6"}) == (0, 1)  # 6 % 4 = ep 1, tp 0
    assert resolve_ranks(2, None, 1, None, env={"RANK": "1", "INFER_TP_SUPERVISED": "1"}) == (None, None)
    with pytest.raises(ValueError, match="RANK must be an integer"):
        resolve_ranks(2, None, 1, None, env={"RANK": "x"})
    with pytest.raises(ValueError, match="--tp-rank needs --dist-init"):
        TpOptions(size=2, rank=1, dist_init=None)
    with pytest.raises(ValueError, match="at least 2"):
        TpOptions(size=1, rank=None, dist_init=None)


def test_llm_with_tensor_parallel_size_2_equals_one_process(tiny_model_dir):
    from infer import LLM, SamplingParams

    path = str(tiny_model_dir("llama"))
    prompts = [list(range(5, 9)), list(range(30, 70)), [7]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    options = dict(dtype="float32", max_model_len=128, kv_cache_memory=4_000_000, num_threads=1)
    want = [c.token_ids for c in LLM(model=path, **options).generate(prompts, params, use_tqdm=False)]
    with LLM(model=path, tensor_parallel_size=2, **options) as llm:
        assert llm.engine.tp.size == 2 and llm.engine.model.num_kv_heads == 1
        assert [c.token_ids for c in llm.generate(prompts, params, use_tqdm=False)] == want
        children = llm.engine.runner.followers._children
    assert all(child.poll() is not None for child in children)  # close() ended TP rank 1
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        LLM(model=path, tensor_parallel_size=0)


def test_a_step_batch_crosses_the_command_channel_whole():
    """What rank 0 sends its followers (and a pipeline's stages) decodes to the same batch, prefill_decode_from
    included: a recomputed generated row (a resumed stream, a preemption) takes the decode arithmetic on every
    rank, not on rank 0 alone. So do a vision model's image rows and features (bf16 ones too, which numpy has no
    type for), its images' spans and M-RoPE positions: rank 0 alone runs the vision tower."""
    import dataclasses

    import msgpack

    from infer.worker.parallel.tp_commands import decode_batch, encode_batch

    plain = _batch(list(range(3, 40)))
    resumed = dataclasses.replace(plain, prefill_decode_from=torch.tensor([30], dtype=torch.int32))
    generator = torch.Generator().manual_seed(3)
    images = dataclasses.replace(
        plain,
        image_rows=torch.arange(4, 20, dtype=torch.int64),
        image_embeds=torch.randn(16, 8, generator=generator).to(torch.bfloat16),
        image_spans=((0, 4, 20),),
        mrope_positions=torch.randint(0, 40, (3, 37), generator=generator),
        rope_cache=torch.randn(37, 8, generator=generator),
    )
    for batch in (plain, resumed, images):
        got = decode_batch(msgpack.unpackb(msgpack.packb(encode_batch(batch), use_bin_type=True), raw=False), CPU)
        for f in dataclasses.fields(batch):
            mine, theirs = getattr(batch, f.name), getattr(got, f.name)
            if isinstance(mine, torch.Tensor):
                assert torch.equal(mine, theirs), f.name
            elif f.name != "per_step":
                assert mine == theirs, f.name

"""Encoder-decoder models (T5 v1.1 / Flan-style, the original T5, BART) against transformers on tiny random
checkpoints (tests/encdec_models.py): greedy tokens equal transformers' `generate` in fp32 through `LLM.generate`,
requests of different encoder lengths batched together, with vLLM's {"encoder_prompt", "decoder_prompt"} form, in
prefill chunks, and through preemption by recompute (the encoder runs again); the cross-attention blocks are counted
at admission and freed with the request; hostile input and unsupported options are refused by name, and the engine
goes on serving."""

from __future__ import annotations

import random

import pytest
import torch
from encdec_models import encdec_checkpoint, hf_encdec, transformers_greedy

from infer import LLM, SamplingParams
from infer.worker.engine.block_manager import BlockManager
from infer.worker.engine.request import Request

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
OPTIONS = dict(dtype="float32", max_model_len=64, kv_cache_memory=4_000_000, num_threads=1, block_size=4)
_rng = random.Random(7)
PROMPTS = [[_rng.randrange(3, 250) for _ in range(n)] for n in (5, 11, 23, 2)]
DECODER_PREFIX = [17, 42, 99]


@pytest.fixture(scope="module", params=["t5", "t5-original", "bart"])
def family(request, tmp_path_factory, smollm2_tokenizer):
    name = request.param
    path = encdec_checkpoint(name, tmp_path_factory.mktemp(name), smollm2_tokenizer)
    model = hf_encdec(path)
    want = transformers_greedy(path, PROMPTS, MAX_NEW, model=model)
    prefixed = transformers_greedy(path, PROMPTS[:2], MAX_NEW, [DECODER_PREFIX] * 2, model=model)
    return name, path, want, prefixed


def _tokens(llm: LLM, prompts: list, params: SamplingParams = GREEDY) -> list[list[int]]:
    completions = llm.generate(prompts, params, use_tqdm=False)
    assert all(c.finish_reason == "length" for c in completions), [c.error for c in completions]
    return [c.token_ids for c in completions]


def test_greedy_equals_transformers(family):
    name, path, want, prefixed = family
    llm = LLM(model=str(path), **OPTIONS)
    try:
        assert _tokens(llm, PROMPTS) == want  # four encoder lengths, one batch
        forms = [{"encoder_prompt": p, "decoder_prompt": DECODER_PREFIX} for p in PROMPTS[:2]]
        forms.append({"encoder_prompt": {"prompt_token_ids": PROMPTS[2]}})
        assert _tokens(llm, forms) == [*prefixed, want[2]]
        ids = llm.get_tokenizer().encode("The house", add_special_tokens=False)  # text: no special tokens added
        text_form = {"encoder_prompt": PROMPTS[0], "decoder_prompt": "The house"}
        assert _tokens(llm, [text_form]) == _tokens(llm, [{"encoder_prompt": PROMPTS[0], "decoder_prompt": ids}])
        completion = llm.generate([PROMPTS[1]], GREEDY, use_tqdm=False)[0]
        assert completion.prompt_token_ids == PROMPTS[1]  # the encoder's input, as given
        # the pool is whole again: every self and cross block came back
        assert llm.stats().workers[0].load.num_free_blocks == llm.stats().workers[0].load.num_total_blocks
    finally:
        llm.close()


def test_an_in_memory_transformers_model(family, smollm2_tokenizer):
    """LLM(model=<transformers' model object>): its tensors copied into ours by their checkpoint names (the tied
    embeddings, BART's final_logits_bias buffer)."""
    name, path, want, _ = family
    llm = LLM(model=hf_encdec(path), tokenizer=smollm2_tokenizer, **OPTIONS)
    try:
        assert _tokens(llm, PROMPTS[:2]) == want[:2]
    finally:
        llm.close()


def test_prefill_chunks_and_preemption(family):
    """A 3-token budget splits the decoder prompts' prefill; a pool of 16 blocks holds two of these requests at a
    time, so the others wait or are preempted (their cross blocks freed, their encoder run again on return)."""
    name, path, want, prefixed = family
    forms = [{"encoder_prompt": p, "decoder_prompt": DECODER_PREFIX} for p in PROMPTS[:2]]
    chunked = LLM(model=str(path), **{**OPTIONS, "max_num_batched_tokens": 3, "enable_chunked_prefill": True})
    try:
        assert _tokens(chunked, forms) == prefixed
    finally:
        chunked.close()
    per_block = 4 * 2 * 2 * _heads_dim(name) * 4  # block_size x (K, V) x layers x heads*dim x fp32
    small = LLM(model=str(path), **{**OPTIONS, "kv_cache_memory": 16 * per_block})
    try:
        assert small.stats().workers[0].load.num_total_blocks == 16
        assert _tokens(small, PROMPTS[:3] * 2) == want[:3] * 2
        assert small.stats().workers[0].load.num_preemptions > 0
    finally:
        small.close()


def _heads_dim(name: str) -> int:
    return 32  # every tiny family has 4 heads of 8 (tests/encdec_models.py)


def test_hostile_input_refused_by_name(family):
    name, path, want, _ = family
    llm = LLM(model=str(path), **OPTIONS)
    try:
        too_long = list(range(3, 3 + 65))
        bad = llm.generate(
            [too_long, [], {"encoder_prompt": PROMPTS[0], "decoder_prompt": [10**6]}, {"decoder_prompt": [5]}],
            GREEDY,
            use_tqdm=False,
        )
        assert [c.finish_reason for c in bad] == ["error"] * 4
        assert "encoder prompt has 65 tokens, more than the encoder takes (64)" in bad[0].error
        assert "empty" in bad[1].error
        assert "decoder prompt token id 1000000 is outside the vocabulary" in bad[2].error
        assert "needs 'encoder_prompt'" in bad[3].error
        beam = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4, temperature=0, beam_width=2), use_tqdm=False)[0]
        assert beam.finish_reason == "error" and "beam search" in beam.error
        assert _tokens(llm, PROMPTS[:1]) == want[:1]  # still serving
    finally:
        llm.close()


def test_pool_too_small_for_the_cross_blocks_refused(family):
    """A request whose cross blocks and decoder blocks together exceed the pool is refused at once, by name."""
    name, path, _, _ = family
    per_block = 4 * 2 * 2 * _heads_dim(name) * 4
    llm = LLM(model=str(path), **{**OPTIONS, "kv_cache_memory": 8 * per_block})
    try:
        out = llm.generate([list(range(3, 3 + 30))], GREEDY, use_tqdm=False)[0]
        assert out.finish_reason == "error"
        assert "encoder prompt of 30 tokens needs 8 KV blocks of cross-attention" in out.error
    finally:
        llm.close()


@pytest.mark.parametrize(
    "option, named",
    [
        (dict(enforce_eager=False), "step graphs"),
        (dict(enable_lora=True), "LoRA"),
        (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}), "speculative decoding"),
        (dict(quantization="int8"), "quantization 'int8'"),
    ],
)
def test_unsupported_engine_options_refused(family, option, named):
    name, path, _, _ = family
    with pytest.raises(ValueError, match=f"encoder-decoder model.*{named}"):
        LLM(model=str(path), **{**OPTIONS, **option})


def test_decoder_only_model_refuses_a_decoder_prompt(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir("llama")), **OPTIONS)
    try:
        out = llm.generate([{"encoder_prompt": [5, 6, 7], "decoder_prompt": [8]}], GREEDY, use_tqdm=False)[0]
        assert out.finish_reason == "error"
        assert "decoder_prompt is for encoder-decoder models" in out.error
        assert len(_tokens(llm, [[5, 6, 7]])[0]) == MAX_NEW  # still serving
    finally:
        llm.close()


def test_bf16_agreement(family):
    """bf16 against transformers' bf16 on the same weights: the share of greedy tokens equal before the first
    difference, over the prompts (random tiny weights make near-ties common; the fp32 test above is the exact one)."""
    name, path, _, _ = family
    reference = transformers_greedy(path, PROMPTS, MAX_NEW, model=hf_encdec(path, torch.bfloat16))
    llm = LLM(model=str(path), **{**OPTIONS, "dtype": "bfloat16"})
    try:
        got = _tokens(llm, PROMPTS)
    finally:
        llm.close()
    same = sum(_common_prefix(a, b) for a, b in zip(got, reference)) / (MAX_NEW * len(PROMPTS))
    print(f"{name} bf16: {same:.0%} of greedy tokens equal transformers' bf16 before the first difference")
    assert same >= 0.5


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_a_step_s_new_requests_share_one_encoder_pass(family):
    """The four prompts arrive together: one encoder pass over their tokens end to end (each one's attention its
    own), with transformers' tokens (test_greedy_equals_transformers's); a request that arrives later gets a pass
    of its own."""
    name, path, want, _ = family
    with LLM(model=str(path), **OPTIONS) as llm:
        model = llm.engine.model
        passes: list[list[int]] = []
        encode = model.encode

        def recording(input_ids, lengths, slots, kv_cache):
            passes.append(list(lengths))
            return encode(input_ids, lengths, slots, kv_cache)

        model.encode = recording
        assert _tokens(llm, PROMPTS) == want
        assert passes == [[len(p) for p in PROMPTS]]
        assert _tokens(llm, PROMPTS[1:2]) == want[1:2]
        assert passes[1:] == [[len(PROMPTS[1])]]


def test_the_generation_config_s_forced_bos_and_eos_as_transformers_applies_them(tmp_path, smollm2_tokenizer):
    """BART-large-CNN's config forces the first generated token to BOS and the last one max_new_tokens allows to EOS:
    the tokens equal transformers' `generate` with the checkpoint's own generation config, for a decoder that starts
    from its start token alone (BOS forced) and one with a prefix (not: transformers forces it at the first position
    only); an output that ends earlier on its own EOS ends there in both; ignore_eos turns the forced EOS off."""
    import json

    path = encdec_checkpoint("bart", tmp_path / "bart", smollm2_tokenizer, forced_eos_token_id=2)
    generation = json.loads((path / "generation_config.json").read_text())  # BartConfig 5 keeps no forced BOS
    (path / "generation_config.json").write_text(json.dumps({**generation, "forced_bos_token_id": 1}))
    model = hf_encdec(path)
    assert (model.generation_config.forced_bos_token_id, model.generation_config.forced_eos_token_id) == (1, 2)

    def transformers_tokens(ids: list[int], decoder: list[int]) -> list[int]:
        with torch.inference_mode():
            y = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.int64),
                decoder_input_ids=torch.tensor([[model.config.decoder_start_token_id, *decoder]]),
                do_sample=False,
                num_beams=1,
                max_new_tokens=MAX_NEW,
            )
        return y[0, 1 + len(decoder) :].tolist()

    params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    with LLM(model=str(path), **OPTIONS) as llm:
        plain = llm.generate(PROMPTS, params, use_tqdm=False)
        prefixed = llm.generate([{"encoder_prompt": PROMPTS[0], "decoder_prompt": DECODER_PREFIX}], params, False)
        free = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0]  # ignore_eos
    for prompt, completion in zip(PROMPTS, plain, strict=True):
        assert completion.token_ids == transformers_tokens(prompt, [])
        assert completion.token_ids[0] == 1 and completion.token_ids[-1] == 2  # forced (or its own EOS)
    assert prefixed[0].token_ids == transformers_tokens(PROMPTS[0], DECODER_PREFIX)
    assert prefixed[0].token_ids[0] != 1 or transformers_tokens(PROMPTS[0], DECODER_PREFIX)[0] == 1
    assert len(free.token_ids) == MAX_NEW and free.token_ids[0] == 1
    assert any(len(c.token_ids) == MAX_NEW and c.finish_reason == "stop" for c in plain)  # an EOS that was forced


def test_cross_blocks_taken_at_admission_and_freed_with_the_request():
    """Torch-free: the first allocation takes the encoder's blocks too (counted in num_blocks_to_allocate); a
    second allocation takes none; free gives all back and marks the encoder's output gone."""
    blocks = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    request = Request("r", [0], SamplingParams(), encoder_token_ids=list(range(9)))
    assert blocks.num_blocks_to_allocate(request, 1) == 1 + 3
    assert blocks.allocate(request, 1)
    assert len(request.cross_block_table) == 3 and blocks.num_free_blocks == 6
    request.encoder_computed = True
    request.num_computed_tokens = 1
    request.token_ids.append(5)
    assert blocks.num_blocks_to_allocate(request, 1) == 0
    blocks.check_invariants(holders=[request])
    blocks.free(request)
    assert blocks.num_free_blocks == 10 and not request.cross_block_table and not request.encoder_computed
    blocks.check_invariants(holders=[])
    big = Request("big", [0], SamplingParams(), encoder_token_ids=list(range(40)))
    assert not blocks.allocate(big, 1) and not big.cross_block_table  # 10 cross + 1 > 10: nothing taken

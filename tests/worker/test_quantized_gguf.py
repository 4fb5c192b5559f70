"""The embedded model kept quantized, per GGUF format: teacher-forced logits against the same file dequantized, and
greedy text against llama.cpp's on the same file.

Formats. Q4_1 is the embedded file itself (its token_embd, the tied LM head, is Q8_0). Q8_0, Q4_0 and Q5_1 are
made here: every metadata field and tensor of the embedded file copied by gguf-py's GGUFWriter, the matrices
(token_embd included) dequantized and requantized with gguf.quants.quantize (so a Q4_0 file has a 4-bit LM head
too). The K-quants (Q4_K, Q5_K, Q6_K) are not here: gguf-py cannot quantize them (NotImplementedError), and
SmolLM2's 576-wide rows are no whole super-blocks of 256 anyway; test_gguf.py covers their decoding and repack.
Each storage our kernels compute on is here once or more: q4 (Q4_0), q4 with mins (Q4_1), q8 (Q8_0, and Q4_1's
LM head), q8 with mins (Q5_1). Q5_0 repacks exactly into q8 without mins (test_gguf.py, bit for bit), the storage
Q8_0's teacher-forced run computes on with the same kernels: its row below was measured once and is no longer run
(a whole file requantized and a float64 reference: ~20 s of this module on the 2-core CI machine).

Teacher-forced logits. PARAGRAPH (367 tokens of plain English) in one prefill through the engine's model
(quantization "auto": the GGUF's blocks kept as they are) in float32 and in bfloat16, against the reference: our
model of the same file with quantization "none" (dequantized) in float64. The weights are the same numbers on
both sides (the repacks of these formats are exact), so what is measured is our arithmetic: mostly the int8
quantization of the activations per block of 32 in kernels/cpu/quant.c (the same model with those activations
fake-quantized in float64 measured KL 2.5e-3 for Q4_1 over a 233-token paragraph; with them unquantized, fp32
weight-only, 6e-12).

    Mean KL(reference || ours) and top-1 agreement over PARAGRAPH's 367 positions, measured on the 2-core dev VM
    (AVX-512 VNNI / BF16, 2026-11-27) with each build of the native kernels (INFER_CPU_ISA avx512 / avx2 /
    generic: the same integer dots, fp32 sums in other orders), and the bounds tested (BOUNDS: about twice the
    largest KL, top-1 >= 0.90 for all: the measured top-1 moves by 2-3 points from build to build, the noise of
    ~20 near ties flipping among 367 positions):

    format  storage   float32 KL (builds)      top-1          bfloat16 KL (builds)     top-1          KL bound
    Q4_1    q4 (+q8)  2.73 / 2.47 / 2.69e-3    .935-.962      3.58 / 3.45 / 3.60e-3    .935-.940      6 / 7.5e-3
    Q8_0    q8        2.68 / 2.60 / 2.71e-3    .943-.954      3.44 / 3.52 / 3.48e-3    .937-.956      6 / 7e-3
    Q4_0    q4        3.13 / 3.12 / 3.11e-3    .970-.976      4.21 / 4.52 / 4.16e-3    .951-.967      6.5 / 9e-3
    Q5_0    q8        2.63 / 2.79 / 2.66e-3    .962-.981      3.72 / 3.73 / 3.75e-3    .943-.965      (not run)
    Q5_1    q8+min    3.24 / 3.32 / 3.17e-3    .948-.967      4.27 / 4.19 / 4.05e-3    .948-.967      7 / 9e-3

    (Q4_1's token_embd is Q8_0, so its LM head is q8; the made files' LM head is in the file's format.) The bounds
    do see a change of weights of a format's own size: our Q5_1 model against the Q8_0 file's reference measured KL
    0.12, Q4_0 against Q4_1's 0.35. Without the native kernels (INFER_CPU_KERNELS=0: the twin multiplies the
    dequantized weights in fp32, activations unquantized) Q4_1 measured KL 6e-12 in float32, 8.7e-4 in bfloat16.

Greedy text. llama.cpp quantizes activations the same way (q8 blocks of 32), so its greedy text on the same
file is the reference (LLAMA_CPP, for Q4_1 and the made Q8_0). The engine's 24 greedy tokens of each prompt (raw
text, no chat template, no BOS: the file's tokenizer.ggml.add_bos_token is false, and the prompt ids are
llama.cpp's) must hold the prompt's key word and follow llama.cpp's for the prompt's `agreed` tokens: those before
the first near tie along llama.cpp's text, the first position where the dequantized model in float64 prefers
llama.cpp's token by less than 0.5 nats (over PARAGRAPH, our int8 activations moved the gap between the float64
model's top two logits by 0.07-0.09 at the median, 0.3-0.5 at the 99th percentile, 0.64 at most). Beyond a near tie the two texts may part, so the
rest is held in total: the prompts' agreed prefixes add up to at least MIN_AGREED_IN_ALL tokens. Measured (agreed
prefix per prompt, sum; native kernels at avx512 / avx2 / generic):

    Q4_1 float32   [14 10 24 8 15] 71,  [24 10 24 8 24] 90,  [5 10 24 8 24] 71
    Q4_1 bfloat16  [24 10 24 19 24] 101, [5 10 11 24 24] 74, [5 10 24 8 24] 71
    Q8_0 float32   [19 11 24 19 23] 96, [24 11 24 19 18] 96, [24 11 24 19 11] 89
    Q8_0 bfloat16  [17 11 11 19 15] 73, [24 11 24 19 23] 101, [19 11 11 19 24] 84
    stated         [5 8 5 5 9], sum >= 55 (the twins, INFER_CPU_KERNELS=0: 62-93)

The Q4_1 continuation of the Jupiter question ends at EOS after "Jupiter." (11 tokens) where llama.cpp's goes on:
the float64 model prefers EOS there too, by 0.18 over llama.cpp's "\n". A prompt the issue suggested, "Water boils at a temperature of",
is not here: its third token is a near tie (0.34), and both systems say 1,000°C.
"""

from __future__ import annotations

import dataclasses
import functools
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType, LlamaFileType
from model_batches import Pager, new_cache

from infer import SamplingParams
from infer.worker.engine.config import EngineConfig
from infer.worker.engine.engine import Engine
from infer.worker.loading.gguf import GGUFFile, GGUFTensor
from infer.worker.loading.loader import GGUF_FORMATS, load_model
from infer.worker.models.layers import QuantStorage

CPU = torch.device("cpu")
SHIPPED = "Q4_1"
MADE = {
    "Q8_0": LlamaFileType.MOSTLY_Q8_0,
    "Q4_0": LlamaFileType.MOSTLY_Q4_0,
    "Q5_1": LlamaFileType.MOSTLY_Q5_1,
}
FORMATS = (SHIPPED, *MADE)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# format -> dtype -> (mean KL below, top-1 agreement at least): see the module docstring
BOUNDS = {
    "Q4_1": {"float32": (6e-3, 0.9), "bfloat16": (7.5e-3, 0.9)},
    "Q8_0": {"float32": (6e-3, 0.9), "bfloat16": (7e-3, 0.9)},
    "Q4_0": {"float32": (6.5e-3, 0.9), "bfloat16": (9e-3, 0.9)},
    "Q5_1": {"float32": (7e-3, 0.9), "bfloat16": (9e-3, 0.9)},
}

PARAGRAPH = (
    "The river begins as a thin stream high in the mountains, where snow melts slowly through the spring and early "
    "summer. As it moves down the valley, smaller creeks join it, and by the time it reaches the first town it is "
    "wide enough for boats. For centuries the people who lived along its banks depended on it for water, food and "
    "travel. Farmers used its floods to enrich their fields, while merchants carried grain, wool and timber to the "
    "markets downstream. In the nineteenth century engineers built locks and dams to control the water and to make "
    "the river easier to navigate. These changes brought new trade and industry, but they also changed the habitats "
    "of the fish and birds that had lived there for thousands of years. Today scientists measure the temperature and "
    "the flow of the river every day, and volunteers count the salmon that return each autumn to lay their eggs in "
    "the gravel beds upstream. Many of the old mills have become museums, and a long path for walkers and cyclists "
    "now follows the river from the mountains to the sea.\n\n"
    "A good loaf of bread needs only flour, water, salt and yeast, but the baker's patience matters as much as the "
    "ingredients. After the dough is mixed, it rests for several hours while the yeast turns sugars into gas and the "
    "gluten slowly develops. The baker then folds the dough, shapes it into a round loaf and lets it rise a second "
    "time in a warm corner of the kitchen. Just before baking, a sharp knife cuts a shallow line across the top so "
    "that the loaf can expand evenly in the heat. The oven should be very hot at first, because the sudden heat "
    "gives the bread its height and a thin, crisp crust. When the loaf sounds hollow as you tap its base, it is "
    "ready, although it is wise to let it cool for an hour before cutting the first slice."
)


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """The module's models and engines run on one torch thread, restored afterwards. Results do not depend on
    the thread count (kernels/quant.py), but times do: with every core's thread in use, a machine shared with other
    work made each OpenMP barrier wait for a descheduled thread, and a decode step took 1.2 s instead of 6 ms
    (2-core dev VM, 2026-11-27)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------------------------
# The files


def requantize_gguf(reader: gguf.GGUFReader, dest: Path, qtype: Q, file_type: LlamaFileType) -> None:
    """The file `reader` reads rewritten as `dest`: every metadata field as it is (general.file_type set to
    `file_type`), the float tensors as they are, every quantized matrix dequantized (worker/loading/gguf.py) and quantized
    to `qtype` by gguf-py. Tensors keep their GGUF names, order and row order (attn_q / attn_k stay permuted as
    llama.cpp stores them: the GGUFTensor made here has no row order)."""
    writer = gguf.GGUFWriter(dest, str(reader.fields["general.architecture"].contents()))
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":  # the writer writes these itself
            continue
        value = int(file_type) if key == "general.file_type" else field.contents()
        item_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, field.types[0], item_type)
    for tensor in reader.tensors:
        if tensor.tensor_type in (Q.F32, Q.F16, Q.BF16):
            writer.add_tensor(tensor.name, np.asarray(tensor.data))
            continue
        shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
        values = GGUFTensor(tensor.name, tensor.tensor_type, tensor.data, shape).dequantize(torch.float32).numpy()
        writer.add_tensor(tensor.name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


class OnFirstUse(dict):
    """A dict that makes a missing value by `make(key)` when it is first asked for, and keeps `keep` values (the
    latest)."""

    def __init__(self, make: Callable[[Any], Any], keep: int | None = None, **given: Any) -> None:
        super().__init__(given)
        self.make, self.keep = make, keep

    def __missing__(self, key: Any) -> Any:
        value = self.make(key)
        while self.keep is not None and self and len(self) >= self.keep:
            del self[next(iter(self))]
        self[key] = value
        return value


@pytest.fixture(scope="module")
def model_dirs(smollm2_dir: Path, smollm2_gguf: Path, tmp_path_factory) -> Iterator[dict[str, Path]]:
    """Format name -> a model directory (the embedded conversion's config and tokenizer, model.gguf linking to
    the file in that format), the made files written on first use and deleted with the module (~100 MB each)."""
    source = functools.cache(lambda: gguf.GGUFReader(smollm2_gguf))  # the embedded file, read once (seconds)
    made: list[Path] = []

    def make(name: str) -> Path:
        folder = tmp_path_factory.mktemp(f"smollm2-{name}")
        made.append(folder)
        for item in smollm2_dir.iterdir():
            if item.name != "model.gguf":
                shutil.copy(item, folder / item.name)
        requantize_gguf(source(), folder / "weights.gguf", Q[name], MADE[name])
        (folder / "model.gguf").symlink_to(folder / "weights.gguf")
        return folder

    yield OnFirstUse(make, **{SHIPPED: smollm2_dir})
    for folder in made:
        shutil.rmtree(folder)


def storage_formats(model) -> dict[str, str | None]:
    return {name: m.quant_format for name, m in model.named_modules() if isinstance(m, QuantStorage)}


def test_a_made_file_holds_its_format_and_the_embedded_model_s_weights(model_dirs) -> None:
    made, shipped = GGUFFile(model_dirs["Q5_1"] / "model.gguf"), GGUFFile(model_dirs[SHIPPED] / "model.gguf")
    assert [name for name, _ in made.tensors()] == [name for name, _ in shipped.tensors()]
    types = {name: tensor.ggml_type for name, tensor in made.tensors()}
    assert types["model.embed_tokens.weight"] == types["model.layers.29.mlp.down_proj.weight"] == "Q5_1"
    assert types["model.layers.0.input_layernorm.weight"] == "F32"
    assert made.metadata("general.file_type") == LlamaFileType.MOSTLY_Q5_1
    for key in ("tokenizer.ggml.merges", "tokenizer.ggml.tokens", "llama.rope.freq_base"):
        assert made.metadata(key) == shipped.metadata(key)
    # Q4_1 -> Q5_1: each value of a block moves by at most half of Q5_1's step, (max - min) / 31, plus the fp16
    # rounding of the new scale and min
    old = shipped.tensor("model.layers.3.self_attn.q_proj.weight").dequantize().reshape(-1, 32)
    new = made.tensor("model.layers.3.self_attn.q_proj.weight").dequantize().reshape(-1, 32)
    span = old.amax(-1, keepdim=True) - old.amin(-1, keepdim=True)
    assert ((new - old).abs() <= span / 62 + 2**-10 * old.abs().amax(-1, keepdim=True)).all()


# ---------------------------------------------------------------------------------------------------------
# Teacher-forced logits


def all_logits(model, ids: list[int]) -> torch.Tensor:
    """float64 [len(ids), vocab]: the logits at every position of one prefill of `ids`."""
    block_size = 16
    num_blocks = -(-len(ids) // block_size)
    batch = Pager(num_blocks, block_size).batch([("a", ids, 0, len(ids))])
    batch = dataclasses.replace(batch, logits_indices=torch.arange(len(ids)))
    with torch.inference_mode():
        return model.compute_logits(model(batch, new_cache(model, num_blocks, block_size))).double()


def kl_and_top1(reference: torch.Tensor, ours: torch.Tensor) -> tuple[float, float]:
    """Mean KL(reference || ours) over the positions, and the share of positions with the same argmax."""
    p, q = reference.log_softmax(-1), ours.log_softmax(-1)
    kl = (p.exp() * (p - q)).sum(-1).mean().item()
    return kl, (reference.argmax(-1) == ours.argmax(-1)).double().mean().item()


@pytest.fixture(scope="module")
def paragraph_ids(smollm2_tokenizer) -> list[int]:
    return smollm2_tokenizer(PARAGRAPH, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def reference_logits(model_dirs, paragraph_ids) -> dict[str, torch.Tensor]:
    """Format name -> the logits of PARAGRAPH by the file dequantized, in float64 (computed on first use; only the
    latest format's are kept, 140 MB: the tests run format by format)."""

    def make(name: str) -> torch.Tensor:
        return all_logits(load_model(model_dirs[name], torch.float64, CPU, quantization="none"), paragraph_ids)

    return OnFirstUse(make, keep=1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", FORMATS)
def test_teacher_forced_logits_stay_within_the_format_s_bound_of_the_dequantized_file(
    model_dirs, reference_logits, paragraph_ids, name, dtype
) -> None:
    model = load_model(model_dirs[name], DTYPES[dtype], CPU)  # quantization "auto": the file's own blocks
    layers = storage_formats(model)
    assert layers["model.layers.0.mlp.down_proj"] == layers["model.layers.29.self_attn.qkv_proj"] == GGUF_FORMATS[name]
    assert layers["model.embed_tokens"] == GGUF_FORMATS["Q8_0" if name == SHIPPED else name]
    kl, top1 = kl_and_top1(reference_logits[name], all_logits(model, paragraph_ids))
    max_kl, min_top1 = BOUNDS[name][dtype]
    assert kl < max_kl and top1 >= min_top1, (kl, top1)


# ---------------------------------------------------------------------------------------------------------
# Greedy text against llama.cpp's


class Prompt(NamedTuple):
    text: str
    ids: list[int]  # llama.cpp's tokenization of `text` (no BOS: the file's add_bos_token is false)
    key_word: str
    agreed: int  # tokens that must equal llama.cpp's: those before its first near tie (module docstring)


PROMPTS = (
    Prompt("The capital of France is", [504, 3575, 282, 4649, 314], "Paris", 5),
    Prompt(
        "Question: What is the largest planet in our solar system?\nAnswer:",
        [17872, 42, 1812, 314, 260, 3995, 3925, 281, 653, 3693, 817, 47, 198, 21350, 42],
        "Jupiter",
        8,
    ),
    Prompt("The chemical symbol for gold is", [504, 2819, 3573, 327, 4231, 314], "Au", 5),
    Prompt("Photosynthesis is the process by which", [33580, 14870, 314, 260, 980, 411, 527], "sunlight", 5),
    Prompt("List three fruits:\n1.", [6106, 1296, 5574, 42, 198, 33, 30], "Apple", 9),
)
# llama.cpp's greedy continuations of PROMPTS on the same files, recorded once (not in CI: it has no llama.cpp) with
# llama-server of llama.cpp build 0c1e570 (2026-10-01), CPU, 2 threads, on 2026-11-27: POST /completion with the
# prompt's token ids, n_predict 24, temperature 0 (greedy), cache_prompt false; the ids are its "tokens". Q8_0: the
# file requantize_gguf writes (the same bytes every time: sha256 0c1d3326cd9793cf...).
LLAMA_CPP = {
    "Q4_1": (
        # ' Paris.\n\nThe United States has a population of approximately 311 million people.\n\nThe United States'
        [
            7042,
            30,
            198,
            198,
            504,
            1797,
            1918,
            553,
            253,
            2155,
            282,
            4723,
            216,
            35,
            33,
            33,
            2215,
            701,
            30,
            198,
            198,
            504,
            1797,
            1918,
        ],
        # ' The largest planet in our solar system is Jupiter.\n\nThe answer is: 1.\n\nThe answer is'
        [
            378,
            3995,
            3925,
            281,
            653,
            3693,
            817,
            314,
            14713,
            30,
            198,
            198,
            504,
            2988,
            314,
            42,
            216,
            33,
            30,
            198,
            198,
            504,
            2988,
            314,
        ],
        # ' Au.\n\nThe gold market is a global market where gold is traded on a global scale. Gold is a precious'
        [
            36613,
            30,
            198,
            198,
            504,
            4231,
            2342,
            314,
            253,
            2224,
            2342,
            837,
            4231,
            314,
            21939,
            335,
            253,
            2224,
            3964,
            30,
            6920,
            314,
            253,
            9764,
        ],
        # ' plants convert sunlight into energy. This process involves a series of chemical reactions that take place in
        # the leaves of plants. The'
        [
            2109,
            7728,
            8118,
            618,
            1439,
            30,
            669,
            980,
            3445,
            253,
            3086,
            282,
            2819,
            6620,
            338,
            1188,
            1379,
            281,
            260,
            3711,
            282,
            2109,
            30,
            378,
        ],
        # ' Banana\n2. Apple\n3. Grapefruit\n\nThe original sentence is:\n\n"The new'
        [
            12619,
            3231,
            198,
            34,
            30,
            10910,
            198,
            35,
            30,
            4924,
            432,
            25403,
            198,
            198,
            504,
            2798,
            6330,
            314,
            42,
            198,
            198,
            18,
            504,
            725,
        ],
    ),
    "Q8_0": (
        # ' Paris.\n\nThe answer is: 2018-01-22 12:1'
        [7042, 30, 198, 198, 504, 2988, 314, 42, 216, 34, 32, 33, 40, 29, 32, 33, 29, 34, 34, 216, 33, 34, 42, 33],
        # ' The largest planet in our solar system is Jupiter.' and EOS (<|im_end|>)
        [378, 3995, 3925, 281, 653, 3693, 817, 314, 14713, 30, 2],
        # ' Au.\n\nThe gold market is a global market where gold is traded on a global scale. Gold is a precious'
        [
            36613,
            30,
            198,
            198,
            504,
            4231,
            2342,
            314,
            253,
            2224,
            2342,
            837,
            4231,
            314,
            21939,
            335,
            253,
            2224,
            3964,
            30,
            6920,
            314,
            253,
            9764,
        ],
        # ' plants convert sunlight into energy. This process is essential for life on Earth, as it provides the primary
        # source of food for'
        [
            2109,
            7728,
            8118,
            618,
            1439,
            30,
            669,
            980,
            314,
            1895,
            327,
            1029,
            335,
            2591,
            28,
            347,
            357,
            2433,
            260,
            3003,
            2257,
            282,
            1114,
            327,
        ],
        # ' Banana\n2. Apple\n3. Grapefruit\n\nThe original sentence is:\n\n"The fruit'
        [
            12619,
            3231,
            198,
            34,
            30,
            10910,
            198,
            35,
            30,
            4924,
            432,
            25403,
            198,
            198,
            504,
            2798,
            6330,
            314,
            42,
            198,
            198,
            18,
            504,
            4354,
        ],
    ),
}
GREEDY = SamplingParams(temperature=0, max_tokens=24)
MIN_AGREED_IN_ALL = 55  # of the 107 (Q8_0) / 120 (Q4_1) tokens of LLAMA_CPP[format]


def agreed_prefix(ours: list[int], theirs: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))


@pytest.fixture(scope="module")
def greedy_texts(model_dirs) -> dict[tuple[str, str], list[list[int]]]:
    """(format, dtype) -> the engine's greedy tokens of each of PROMPTS (one batch), run on first use."""

    def run(key: tuple[str, str]) -> list[list[int]]:
        name, dtype = key
        engine = Engine(
            EngineConfig(
                model=str(model_dirs[name]), dtype=dtype, max_model_len=256, kv_cache_memory=8_000_000, num_threads=1
            )
        )
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(str(i), prompt.ids, GREEDY)
        tokens: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
        while engine.has_unfinished():
            for out in engine.step():
                tokens[out.request_id] += out.token_ids
        return [tokens[str(i)] for i in range(len(PROMPTS))]

    return OnFirstUse(run)


def test_the_prompts_tokenize_as_llama_cpp_tokenized_them(smollm2_tokenizer) -> None:
    for prompt in PROMPTS:
        assert smollm2_tokenizer(prompt.text, add_special_tokens=False)["input_ids"] == prompt.ids
        assert smollm2_tokenizer(prompt.text)["input_ids"] == prompt.ids  # the tokenizer adds no BOS either


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", LLAMA_CPP)
def test_greedy_text_follows_llama_cpp_s_on_the_same_file(greedy_texts, smollm2_tokenizer, name, dtype) -> None:
    texts = greedy_texts[name, dtype]
    agreed = [agreed_prefix(ours, theirs) for ours, theirs in zip(texts, LLAMA_CPP[name])]
    for prompt, ours, theirs, length in zip(PROMPTS, texts, LLAMA_CPP[name], agreed):
        said = smollm2_tokenizer.decode(ours)
        assert length >= prompt.agreed and prompt.key_word in said, (
            prompt.text,
            said,
            smollm2_tokenizer.decode(theirs),
        )
    assert sum(agreed) >= MIN_AGREED_IN_ALL, agreed

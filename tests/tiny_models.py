"""Tiny random models of each architecture the tests load (tests/conftest.py's `tiny_model_dir`, and the soak
scripts, which run outside pytest)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# The engine options under which tests run a tiny model's decode steps in compiled graphs (CPU step graphs, batch
# buckets 1, 2, 4; fp32, 4-slot blocks, no prefix cache): test_step_graphs, which crosses every bucket's boundaries.
STEP_GRAPH_OPTIONS: dict[str, Any] = dict(
    dtype="float32",
    max_model_len=256,
    num_threads=1,
    device="cpu",
    block_size=4,
    enforce_eager=False,
    max_graph_batch_size=4,
    max_num_seqs=4,
    enable_prefix_caching=False,
)

# One bucket (batch 1, the requests one after another): for tests of whether a model's own layers trace into a step
# graph and give transformers' tokens there (test_families, test_sliding_window_models, test_step_graphs' image
# case). The buckets' padding and boundaries are test_step_graphs's; each bucket is a compile of every distinct layer
# graph (first layer, each window), 8-30 s apiece on a 2-core CI machine with a cold compile cache, so a family's
# three buckets cost it a minute.
ONE_BUCKET_OPTIONS: dict[str, Any] = {**STEP_GRAPH_OPTIONS, "max_graph_batch_size": 1, "max_num_seqs": 1}

TINY_CONFIGS: dict[str, dict] = {
    # Small enough to run in milliseconds, shaped to exercise GQA (4:2, 6:2, 5:1), q/k norm, qkv bias,
    # tied embeddings, rope scaling, sliding-window-free Mistral and a Mistral with a window of 16.
    "llama": dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
    ),
    "mistral": dict(
        model_type="mistral",
        hidden_size=96,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=None,
        rope_theta=1000000.0,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
    "mistral-swa": dict(
        model_type="mistral",
        hidden_size=96,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=16,
        rope_theta=1000000.0,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
    "qwen2": dict(
        model_type="qwen2",
        hidden_size=80,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=5,
        num_key_value_heads=1,
        rope_theta=1000000.0,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        use_sliding_window=False,
    ),
    "qwen3": dict(
        model_type="qwen3",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rope_theta=1000000.0,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        use_sliding_window=False,
    ),
}


def save_tiny_model(arch: str, folder: Path, tokenizer: Any) -> Path:
    """TINY_CONFIGS[arch] with random weights (fixed seed, larger than default so that logits are far from uniform)
    and `tokenizer`, saved in `folder`: loadable by transformers and by our loader."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(TINY_CONFIGS[arch])
    model_type = fields.pop("model_type")
    config = AutoConfig.for_model(
        model_type,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **fields,
    )
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


# A vocabulary unlike SmolLM2's: whole words, so the same text is other ids (and fewer of them) than SmolLM2's BPE.
WORDS = (
    "the a an of to in and is it that for on with as was he she they we you i be at by this have from or one had "
    "not but what all were when there can said use each which do how their if will up other about out many then "
    "them these so some her would make like him into time has look two more write go see number no way could "
    "people my than first water been call who its now find long down day did get come made may part over new "
    "sound take only little work know place year live me back give most very after thing our just name good "
    "sentence man think say great where help through much before line right too mean old any same tell boy "
    "follow came want show also around form three small set put end does another well large must big even such "
    "because turn here why ask went men read need land different home us move try kind hand picture again change "
    "off play spell air away animal house point page letter mother answer found study still learn should world "
    "hello there . , ! ?"
).split()
WORDS_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|> ' + m['content'] + ' <|end|> ' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|> ' }}{% endif %}"
)


def word_level_tokenizer() -> Any:
    """A word-level tokenizer (the tokenizers library, no download) of WORDS, with BOS, EOS, <unk> and a chat
    template of its own (`<|role|> content <|end|>`): a model saved with it has a vocabulary and a chat format
    unlike SmolLM2's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
    vocab = {token: i for i, token in enumerate(specials + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        additional_special_tokens=specials[3:],
    )
    tokenizer.chat_template = WORDS_CHAT_TEMPLATE
    return tokenizer


def save_redrawn(
    model: Any, path: str | Path, tokenizer: Any, ones: tuple[str, ...] = ("norm",), wide: tuple[str, ...] = ()
) -> Path:
    """Every parameter of `model` drawn again from the current torch seed (those whose name holds one of `ones`
    ~ N(1, 0.3), those whose name ends with one of `wide` ~ N(0, 1), the rest ~ N(0, 0.08): logits far from
    uniform), then the model and `tokenizer` saved in `path` (made if missing); returns the path."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if any(part in name for part in ones):
                param.normal_(1.0, 0.3)
            elif wide and name.endswith(wide):
                param.normal_(0.0, 1.0)
            else:
                param.normal_(0.0, 0.08)
    Path(path).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return Path(path)

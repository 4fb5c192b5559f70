"""transformers as the oracle: greedy continuations of token-id prompts on a model directory's weights."""

from __future__ import annotations

from pathlib import Path


def hf_model(model_dir: Path, dtype=None, **options):
    """transformers' own model of a model directory: its safetensors, or the GGUF a conversion directory links to
    (worker/loading/model_files.py; transformers dequantizes it, once per machine: see _dequantized)."""
    import torch
    from transformers import AutoModelForCausalLM

    model_dir = Path(model_dir)
    if (model_dir / "model.gguf").exists():
        model_dir = _dequantized(model_dir)
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype or torch.float32, **options).eval()


def _dequantized(conversion: Path) -> Path:
    """transformers' reading of a conversion directory's GGUF (its config and dequantized float32 weights), saved
    as a safetensors directory the first time and loaded from there after: reading the GGUF took 25-30 s a load on
    the 2-core CI machines (its metadata and vocabulary, then 272 tensors), and the suite loads the embedded model
    as its oracle some fifty times. The weights are exactly transformers' own dequantization; the directory is
    keyed by the file (path, size, mtime) and transformers' version, and written under a lock, whole, by the
    first test process that needs it."""
    import fcntl
    import hashlib
    import os
    import tempfile

    import torch
    import transformers
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM

    gguf = (conversion / "model.gguf").resolve()
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}".encode()).hexdigest()
    root = Path(tempfile.gettempdir()) / "infer-test-oracles"
    root.mkdir(exist_ok=True)
    target = root / key[:16]
    with open(root / f"{key[:16]}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "model.safetensors").exists():
            model = AutoModelForCausalLM.from_pretrained(
                str(conversion), gguf_file="model.gguf", dtype=torch.float32
            ).eval()
            scratch = Path(tempfile.mkdtemp(dir=root))
            config = model.config.to_dict()
            config.pop("quantization_config", None)
            model.config.__class__.from_dict(config).save_pretrained(scratch)
            save_model(model, str(scratch / "model.safetensors"))
            os.replace(scratch, target)
    return target


def first_layers(conversion: Path, num_layers: int, out: Path) -> Path:
    """The embedded model's real weights cut to its first `num_layers` decoder layers (embedding, those layers, the
    final norm, the tied head; transformers' dequantization), saved as a float32 safetensors directory at `out`: the
    real weights' magnitudes, vocabulary and rotary at a fraction of the whole model's compute and step-graph
    compile. (The cut model's text means nothing; its tokens are still compared with transformers'.)"""
    import torch

    model = hf_model(conversion, torch.float32)
    model.model.layers = model.model.layers[:num_layers]
    config = model.config.to_dict()
    config["num_hidden_layers"] = num_layers
    for key in ("layer_types", "quantization_config"):
        config.pop(key, None)
    model.config = model.config.__class__.from_dict(config)
    model.save_pretrained(out)  # the tied head as transformers writes it: the embedding's tensor once
    for item in conversion.iterdir():  # the tokenizer and generation config, not the GGUF link
        if item.name.startswith(("tokenizer", "special_tokens", "generation_config", "chat_template")):
            (out / item.name).write_bytes(item.read_bytes())
    return out


def transformers_greedy(model_dir: Path, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """Exactly `max_new` greedy tokens per prompt (EOS ignored), one prompt at a time (no padding effects)."""
    import torch

    model = hf_model(model_dir)
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                do_sample=False,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                pad_token_id=0,
            )
            outs.append(y[0, len(ids) :].tolist())
    return outs


def assert_bf16_as_close_as_transformers(
    model_dir: Path, ids: list[int], name: str, measure: str = "max", same_at_least: float = 0.8, **options
) -> None:
    """Our bf16 logits of `ids` (one sequence, paged) drift from transformers' fp32 ones no more than 1.5x
    transformers' own bf16 forward does, and pick fp32's next token at `same_at_least` of the positions or more (the
    figures are printed). The drift is each position's largest error relative to the largest fp32 logit, taken by
    `measure`:
    - "max": the largest over the positions;
    - "95%": at 95% of the positions ours within 1.5x transformers' largest (a router whose expert scores nearly tie
      may route one position to another expert in bf16, in ours or in theirs, moving that position's logits);
    - "mean": the mean over the positions, ours against theirs (with a router, the maximum is the one position where
      bf16 rounding flips a top-k expert, which is luck either way).
    `options` go to transformers' model (e.g. attn_implementation)."""
    import torch
    from model_batches import Pager, new_cache

    from infer.worker.loading.loader import load_model

    with torch.inference_mode():
        reference = hf_model(model_dir, **options)(torch.tensor([ids])).logits[0].float()
        theirs = hf_model(model_dir, torch.bfloat16, **options)(torch.tensor([ids])).logits[0].float()
        model = load_model(model_dir, torch.bfloat16, torch.device("cpu"))
        batch = Pager(num_blocks=32, block_size=4).batch([("s", ids, 0, len(ids))])
        ours = model.compute_logits(model(batch, new_cache(model, 32, 4)))

    def drift(logits: torch.Tensor) -> torch.Tensor:  # [positions]
        return (logits - reference).abs().amax(-1) / reference.abs().max()

    same = (ours.argmax(-1) == reference.argmax(-1)).float().mean().item()
    if measure == "max":
        figure, bound = drift(ours).max().item(), 1.5 * drift(theirs).max().item()
    elif measure == "mean":
        figure, bound = drift(ours).mean().item(), 1.5 * drift(theirs).mean().item()
    elif measure == "95%":
        figure = 1.0 - (drift(ours) <= 1.5 * drift(theirs).max()).float().mean().item()
        bound = 0.05  # the share of positions past 1.5x transformers' largest drift
    else:
        raise ValueError(f"measure must be 'max', '95%' or 'mean', got {measure!r}")
    print(
        f"{name} bf16 ({measure}): ours {figure:.3g}, bound {bound:.3g} (transformers' drift "
        f"{drift(theirs).max():.3g} at most); {same:.0%} of the next tokens as fp32"
    )
    assert figure <= bound
    assert same >= same_at_least

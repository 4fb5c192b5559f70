"""LLM: offline batch generation on an in-process engine (vLLM's `LLM`, same names)."""

from __future__ import annotations

import itertools
from typing import Any, Sequence

from infer.protocol.outputs import Completion
from infer.protocol.sampling import SamplingParams

Prompt = str | list[int]


class LLM:
    """`LLM(model=None, **engine_options).generate(prompts, sampling_params)` -> one Completion per prompt.

    Engine options are EngineConfig's fields (vLLM's names: dtype, max_model_len, max_num_seqs,
    max_num_batched_tokens, block_size, kv_cache_memory, enable_prefix_caching, enable_chunked_prefill,
    seed, ...); an unknown name raises ValueError naming it.
    """

    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        from infer.worker.config import EngineConfig
        from infer.worker.engine import Engine

        self.engine = Engine(EngineConfig.from_options(model=model, **engine_options))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[Completion]:
        """Run every prompt in one continuous batch; results come back in prompt order.

        A prompt the engine rejects (empty, too long, unknown token ids, cannot fit in the KV pool)
        yields a Completion with finish_reason "error" and the reason in `error`; the others still run.
        """
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        completions = [self._submit(p, sp) for p, sp in zip(prompts, params)]
        by_id = {c.request_id: c for c in completions if c.finish_reason is None}
        bar = _progress(len(completions), use_tqdm)
        bar.update(len(completions) - len(by_id))
        while self.engine.has_unfinished():
            for delta in self.engine.step():
                completion = by_id.get(delta.request_id)
                if completion is None:
                    continue
                completion.add(delta)
                if delta.finished:
                    bar.update(1)
        bar.close()
        return completions

    def chat(self, messages: list[dict[str, str]] | Sequence[list[dict[str, str]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True) -> list[Completion]:
        """Apply the model's chat template to one conversation (or a list of them) and generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.engine.tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
                   for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _submit(self, prompt: Prompt, params: SamplingParams) -> Completion:
        request_id = f"llm-{next(self._ids)}"
        try:
            request = self.engine.add_request(request_id, prompt, params)
        except ValueError as e:
            ids = list(prompt) if isinstance(prompt, list) else []
            return Completion(request_id, ids, finish_reason="error", error=str(e),
                              prompt=prompt if isinstance(prompt, str) else None)
        return Completion(request_id, list(request.prompt_token_ids),
                          prompt=prompt if isinstance(prompt, str) else None)


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]  # a single token-id prompt
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts must be a string, a token-id list, or a list of those; got {type(prompts).__name__}")
    return [list(p) if isinstance(p, tuple) else p for p in prompts]


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling_params for {n} prompts; pass one, or one per prompt")
    for p in params:
        if not isinstance(p, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(p).__name__}")
    return params


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc="generate", unit="req", disable=not enabled or total < 2, dynamic_ncols=True)

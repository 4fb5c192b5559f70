"""vLLM's tokenizer routes: text or chat messages to token ids and back, with the generation routes' bounds."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from infer.client.api.front import Front
from infer.client.api.schemas import ApiError, DetokenizeRequest, TokenizeRequest


class Tokens:
    """vLLM's POST /tokenize and POST /detokenize: no engine request runs."""

    def __init__(self, front: Front) -> None:
        self.front = front

    async def tokenize(self, request: Request) -> Response:
        """vLLM's /tokenize: a prompt (or chat messages through the template) -> its token ids. The bounds of the
        generation routes apply (the chat template's output checked too), and the ids must fit the context."""
        body = await self.front.parse(request, TokenizeRequest)
        tok = await self.front.tokenization(body)
        max_len = await self.front.any_max_model_len(self.front.model_of(body))
        if body.prompt is not None:
            param = "prompt"
            self.front.check_text_size(tok, body.prompt, max_len, param)
            special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = await self.front.off_loop(tok.encode, body.prompt, add_special_tokens=special)
        else:
            param = "messages"
            tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
            ids = await self.front.chat_prompt(tok, body, tools, max_len)
            if body.add_special_tokens:
                ids = tok.chat_encoder.with_added_special_tokens(ids)
        if len(ids) > max_len:
            raise ApiError(
                400,
                f"{param}: {len(ids)} tokens; this model's maximum context length is {max_len} tokens",
                param=param,
                code="context_length_exceeded",
            )
        strs = [tok.token_text(t) for t in ids] if body.return_token_strs else None
        return JSONResponse({"count": len(ids), "max_model_len": max_len, "tokens": ids, "token_strs": strs})

    async def detokenize(self, request: Request) -> Response:
        """vLLM's /detokenize: token ids -> text (at most the context length of ids, each in the vocabulary)."""
        body = await self.front.parse(request, DetokenizeRequest)
        tok = await self.front.tokenization(body)
        max_len = await self.front.any_max_model_len(self.front.model_of(body))
        if len(body.tokens) > max_len:
            raise ApiError(
                400, f"tokens: {len(body.tokens)} token ids; at most the context length ({max_len})", param="tokens"
            )
        self.front.check_vocab(tok, "tokens", body.tokens)
        text = await self.front.off_loop(tok.tokenizer.decode, body.tokens)
        return JSONResponse({"prompt": text})

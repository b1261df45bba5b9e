"""OpenAI response bodies from engine events: whole responses, stream chunks, usage and log-probabilities."""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from typing import Any

__all__ = ["Choice", "Detokenizer", "Responder", "sse"]


def sse(data: Any) -> str:
    """One server-sent event carrying ``data`` (a JSON document, or the literal ``[DONE]``)."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


class Detokenizer:
    """Text of each generated token, for log-probabilities: the difference the token makes to the decoded text of
    the few tokens before it (decoding a token alone loses leading spaces and splits multi-byte characters)."""

    WINDOW = 4

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []

    def add(self, ids: list[int]) -> list[str]:
        pieces = []
        for token in ids:
            if self.tokenizer is None:
                pieces.append(f"token_id:{token}")
                self.ids.append(token)
                continue
            context = self.ids[-self.WINDOW:]
            before = self.tokenizer.decode(context)
            after = self.tokenizer.decode(context + [token])
            pieces.append(after[len(before):] if after.startswith(before) else self.tokenizer.decode([token]))
            self.ids.append(token)
        return pieces


@dataclasses.dataclass
class Choice:
    """What one choice (one engine request) has produced so far."""

    index: int
    prompt_ids: list[int]
    detokenizer: Detokenizer
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    pieces: list[str] = dataclasses.field(default_factory=list)  # token texts, with logprobs only
    logprobs: list[float] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    announced: bool = False  # streaming: its first chunk was sent

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Responder:
    """Builds the bodies of one /v1/completions or /v1/chat/completions response."""

    def __init__(self, chat: bool, model: str, logprobs: bool, return_token_ids: bool):
        self.chat = chat
        self.model = model
        self.want_logprobs = logprobs
        self.return_token_ids = return_token_ids
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    # -- pieces ------------------------------------------------------------------------------------------------
    def _logprobs(self, choice: Choice, pieces: list[str], logprobs: list[float], text_offset: int) -> dict | None:
        if not self.want_logprobs:
            return None
        if self.chat:
            return {"content": [{"token": p, "logprob": lp, "bytes": list(p.encode("utf-8")), "top_logprobs": []}
                                for p, lp in zip(pieces, logprobs)]}
        if choice.detokenizer.tokenizer is None:
            # No tokenizer: the text is empty and the pieces are placeholders ("token_id:46"), not part of it.
            # Offsets into that empty text are all 0 (a list of ints, as the schema has it, rather than null).
            offsets = [text_offset] * len(pieces)
        else:
            offsets, at = [], text_offset
            for p in pieces:
                offsets.append(at)
                at += len(p)
        # Only the sampled tokens' log-probabilities are computed: no alternatives (top_logprobs is null).
        return {"tokens": pieces, "token_logprobs": logprobs, "top_logprobs": None, "text_offset": offsets}

    def _ids(self, body: dict, choice: Choice, token_ids: list[int], first: bool) -> dict:
        if self.return_token_ids:
            body["token_ids"] = token_ids
            if first:
                body["prompt_token_ids"] = choice.prompt_ids
        return body

    @staticmethod
    def usage(choices: list[Choice]) -> dict:
        prompt = sum(len(c.prompt_ids) for c in choices)
        completion = sum(len(c.token_ids) for c in choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _envelope(self, choices: list[dict], stream: bool) -> dict:
        kind = ("chat.completion.chunk" if stream else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    # -- whole response ----------------------------------------------------------------------------------------
    def response(self, choices: list[Choice]) -> dict:
        bodies = []
        for c in choices:
            lp = self._logprobs(c, c.pieces, c.logprobs, 0)
            if self.chat:
                body = {"index": c.index, "message": {"role": "assistant", "content": c.text}, "logprobs": lp,
                        "finish_reason": c.finish_reason}
            else:
                body = {"index": c.index, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason}
            bodies.append(self._ids(body, c, c.token_ids, True))
        out = self._envelope(bodies, stream=False)
        out["usage"] = self.usage(choices)
        return out

    # -- stream ------------------------------------------------------------------------------------------------
    def chunk(self, choice: Choice, text: str, token_ids: list[int], pieces: list[str], logprobs: list[float],
              text_offset: int, finish_reason: str | None) -> dict:
        """One chunk of ``choice``: its new text and tokens (and the finish reason on its last chunk)."""
        first = not choice.announced
        choice.announced = True
        lp = self._logprobs(choice, pieces, logprobs, text_offset) if token_ids else None
        if self.chat:
            delta: dict = {"role": "assistant", "content": text} if first else {"content": text}
            body = {"index": choice.index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}
        else:
            body = {"index": choice.index, "text": text, "logprobs": lp, "finish_reason": finish_reason}
        return self._envelope([self._ids(body, choice, token_ids, first)], stream=True)

    def usage_chunk(self, choices: list[Choice]) -> dict:
        out = self._envelope([], stream=True)
        out["usage"] = self.usage(choices)
        return out

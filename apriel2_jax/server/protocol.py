"""OpenAI-compatible request bodies (pydantic) and their translation into engine requests.

Bodies are validated strictly (``"5"`` is not a number, ``1.0`` is not an integer) so a client's mistake fails at
once with a 400 naming the field, rather than being coerced into something it did not ask for. Fields of the
OpenAI API this engine cannot honour (``n > 1``, penalties, ``logit_bias``, ``echo``, tool calls, structured
output...) are rejected, never silently ignored. Unknown fields are ignored, as OpenAI-compatible servers commonly
do (clients add their own).

Extensions beyond the OpenAI schema (the names vLLM uses): ``top_k``, ``ignore_eos``, ``stop_token_ids`` and
``return_token_ids`` (each choice also carries its generated ``token_ids``, and the response its
``prompt_token_ids``; always, for a model without a tokenizer, whose text is empty).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..engine.sampling import SamplingError, SamplingParams
from ..engine.tokenizer import with_end_of_turn

__all__ = [
    "APIError",
    "ChatCompletionRequest",
    "CompletionRequest",
    "EngineView",
    "PreparedRequest",
    "error_body",
    "parse_body",
    "prepare_chat",
    "prepare_completion",
]


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type
        self.code = code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param)


# ------------------------------------------------------------------------------------------------------------
# Bodies
# ------------------------------------------------------------------------------------------------------------


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingBody(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=0, le=2**64 - 1)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Extensions.
    top_k: int | None = Field(None, ge=-1)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    return_token_ids: bool = False


class CompletionRequest(_SamplingBody):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # Tool calls, names and the like are passed through to the chat template, which decides what they mean.
    model_config = ConfigDict(strict=True, extra="allow")
    role: str
    content: str | list[TextPart] | None = None  # absent only with an assistant's tool_calls (prepare_chat checks)


class ChatCompletionRequest(_SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # Refused unless they ask for nothing (prepare_chat): the output is never parsed into tool calls or JSON.
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None


# pydantic names union members in error locations ('prompt', 'list[int]', 0); they are not fields.
def _is_union_tag(part: str) -> bool:
    return any(c in part for c in "[-") or part in {"str", "int", "float", "bool", "list", "dict", "none"}


def _param(loc: tuple) -> str | None:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _is_union_tag(part):
            out += f".{part}" if out else part
    return out or None


def parse_body(model: type[_Body], raw: bytes) -> _Body:
    """The validated body, or an APIError(400) naming the first bad field (``messages[0].content``)."""
    if not raw.strip():
        raise APIError(400, "the request body is empty; send a JSON object")
    try:
        return model.model_validate_json(raw)
    except ValidationError as err:
        errors = err.errors(include_url=False)
        first = errors[0]
        # A union reports every member's failure: the one that got furthest into the value says most.
        same_field = [e for e in errors if e["loc"][:1] == first["loc"][:1]]
        first = max(same_field, key=lambda e: len([p for p in e["loc"] if isinstance(p, int) or not _is_union_tag(p)]))
        if first["type"] == "json_invalid":
            raise APIError(400, f"the request body is not valid JSON: {first['msg']}") from None
        if first["type"] == "model_type":
            raise APIError(400, "the request body must be a JSON object") from None
        param = _param(first["loc"])
        if first["type"] == "missing":
            raise APIError(400, f"{param}: this field is required", param=param) from None
        value = first.get("input")
        shown = repr(value) if isinstance(value, (int, float, str, bool)) or value is None else type(value).__name__
        raise APIError(400, f"{param}: {first['msg']} (got {shown})", param=param) from None


# ------------------------------------------------------------------------------------------------------------
# Translation into engine requests
# ------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class EngineView:
    """What translation needs to know about the served model (read once, at start-up)."""

    model_name: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    tokenizer: Any  # apriel2_jax.engine.tokenizer.Tokenizer or None


@dataclasses.dataclass
class PreparedRequest:
    prompts: list[list[int]]  # one engine request per prompt (completions may batch prompts)
    params: SamplingParams
    stream: bool
    include_usage: bool
    logprobs: bool
    return_token_ids: bool


# SamplingParams field -> the request field a client wrote.
_API_FIELD = {"max_new_tokens": "max_tokens"}


def _unsupported(body: _SamplingBody) -> None:
    if body.n != 1:
        raise _bad("n", "only n=1 is supported (send several requests for several samples)")
    if body.presence_penalty or body.frequency_penalty:
        field = "presence_penalty" if body.presence_penalty else "frequency_penalty"
        raise _bad(field, "penalties are not supported by this engine; leave it at 0")
    if body.logit_bias:
        raise _bad("logit_bias", "not supported by this engine")
    if body.stream_options is not None and not body.stream:
        raise _bad("stream_options", "only allowed when stream is true")


def _check_model(body: _SamplingBody, view: EngineView) -> None:
    if body.model is not None and body.model != view.model_name:
        raise APIError(404, f"model {body.model!r} does not exist; this server serves {view.model_name!r} "
                            f"(see /v1/models)", param="model", code="model_not_found")


def _check_prompt(ids: list[int], view: EngineView, param: str) -> None:
    if not ids:
        raise _bad(param, "the prompt is empty")
    bad = [t for t in ids if not 0 <= t < view.vocab_size]
    if bad:
        raise _bad(param, f"token ids {bad[:5]} are outside the vocabulary [0, {view.vocab_size})")
    if len(ids) >= view.max_model_len:
        raise _bad(param, f"the prompt has {len(ids)} tokens; this model's context (max_model_len) is "
                          f"{view.max_model_len}, which must leave room for at least one generated token")


def _sampling_params(body: _SamplingBody, view: EngineView, prompts: list[list[int]], max_tokens: int | None,
                     max_tokens_field: str, default_max_tokens: int | None, logprobs: bool) -> SamplingParams:
    longest = max(len(p) for p in prompts)
    room = view.max_model_len - longest
    if max_tokens is None:
        max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
    elif max_tokens > room:
        raise _bad(max_tokens_field, f"{max_tokens} tokens after a {longest}-token prompt exceed this model's context "
                                     f"(max_model_len {view.max_model_len}); ask for at most {room}")
    stop = body.stop
    if stop is not None and view.tokenizer is None:
        raise _bad("stop", "stop strings need a tokenizer and this model has none; use stop_token_ids")
    stop_ids = tuple(body.stop_token_ids or ())
    if not body.ignore_eos:
        stop_ids = with_end_of_turn(stop_ids, view.tokenizer, view.vocab_size, view.eos_token_ids)
    try:
        return SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_k=0 if body.top_k is None else body.top_k,
            top_p=1.0 if body.top_p is None else body.top_p,
            seed=body.seed,
            max_new_tokens=max_tokens,
            stop_token_ids=stop_ids,
            stop=() if stop is None else stop,
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
        )
    except SamplingError as err:
        field = _API_FIELD.get(err.field, err.field)
        raise _bad(field, f"got {err.value!r}, expected {err.expected}") from None


def prepare_completion(body: CompletionRequest, view: EngineView) -> PreparedRequest:
    _check_model(body, view)
    _unsupported(body)
    if body.echo:
        raise _bad("echo", "not supported by this engine")
    if body.suffix is not None:
        raise _bad("suffix", "not supported by this engine")
    if body.best_of not in (None, 1):
        raise _bad("best_of", "only best_of=1 is supported")
    prompt = body.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise _bad("prompt", "no prompt given (an empty list)")
    prompts = []
    for i, p in enumerate(prompt):
        param = "prompt" if len(prompt) == 1 else f"prompt[{i}]"
        if isinstance(p, str):
            if view.tokenizer is None:
                raise _bad(param, "this model has no tokenizer: send the prompt as a list of token ids")
            ids = view.tokenizer.encode(p)
        else:
            ids = list(p)
        _check_prompt(ids, view, param)
        prompts.append(ids)
    params = _sampling_params(body, view, prompts, body.max_tokens, "max_tokens", 16, body.logprobs is not None)
    # Without a tokenizer the text is empty: the token ids are the answer, so they are always returned.
    return PreparedRequest(prompts, params, body.stream, bool(body.stream_options and body.stream_options.include_usage),
                           body.logprobs is not None, body.return_token_ids or view.tokenizer is None)


def _message_dict(message: ChatMessage) -> dict:
    out = message.model_dump(exclude_none=False)
    if isinstance(message.content, list):  # text parts: one string, as templates expect
        out["content"] = "\n".join(part.text for part in message.content)
    return out


def _check_contents(messages: list[ChatMessage]) -> None:
    """The OpenAI API requires content in every message but an assistant's that carries tool_calls (or the older
    function_call). The body model lets it be absent for that case; a chat template would render a missing one
    as the text "None"."""
    for i, m in enumerate(messages):
        if m.content is not None:
            continue
        extra = m.model_extra or {}
        if m.role == "assistant" and (extra.get("tool_calls") or extra.get("function_call")):
            continue
        raise _bad(f"messages[{i}].content", f"a {m.role!r} message needs content (a string or a list of text "
                                             f"parts); only assistant messages with tool_calls may omit it")


def _unsupported_chat(body: ChatCompletionRequest) -> None:
    """Tool calling and structured output: a client that asks for them relies on the answer's form, which this
    engine does not produce, so they are refused rather than answered with plain text."""
    for field, choice in (("tools", "tool_choice"), ("functions", "function_call")):
        # Tools with a choice of "none" ask for plain text (some agent frameworks always send their tool list).
        if getattr(body, field) and getattr(body, choice) != "none":
            raise _bad(field, f"tool calling is not supported by this engine (the output is not parsed into "
                              f"tool_calls); leave it out or set {choice} to 'none'")
    for field in ("tool_choice", "function_call"):
        # "auto" without tools asks for nothing (some clients always send it); "required" or a named function does.
        if getattr(body, field) not in (None, "none", "auto"):
            raise _bad(field, "tool calling is not supported by this engine; leave it out or set it to 'none'")
    fmt = body.response_format
    if fmt is not None and fmt != {"type": "text"}:
        raise _bad("response_format", "structured output (JSON mode, JSON schema) is not supported by this engine; "
                                      "leave it out or use {\"type\": \"text\"}")


def prepare_chat(body: ChatCompletionRequest, view: EngineView) -> PreparedRequest:
    from ..engine.tokenizer import ChatTemplateError

    _check_model(body, view)
    _unsupported(body)
    if body.top_logprobs:
        raise _bad("top_logprobs", "alternatives are not computed by this engine (only the sampled token's "
                                   "log-probability); use logprobs=true with top_logprobs 0 or unset")
    _unsupported_chat(body)
    tok = view.tokenizer
    if tok is None:
        raise _bad("messages", "this model has no tokenizer, so chat completions are unavailable; use "
                               "/v1/completions with prompts as token-id arrays")
    if not tok.has_chat_template:
        raise _bad("messages", "this model's tokenizer has no chat template; use /v1/completions")
    _check_contents(body.messages)
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        raise _bad("max_completion_tokens", "give max_tokens or max_completion_tokens, not both")
    max_tokens, field = body.max_tokens, "max_tokens"
    if body.max_completion_tokens is not None:
        max_tokens, field = body.max_completion_tokens, "max_completion_tokens"
    try:
        text = tok.apply_chat_template([_message_dict(m) for m in body.messages],
                                       add_generation_prompt=body.add_generation_prompt,
                                       **(body.chat_template_kwargs or {}))
    except ChatTemplateError as err:
        raise _bad("messages", str(err)) from None
    # The template writes the special tokens itself (as apriel2-generate and HF's apply_chat_template do).
    ids = tok.encode(text, add_special_tokens=False)
    _check_prompt(ids, view, "messages")
    params = _sampling_params(body, view, [ids], max_tokens, field, None, body.logprobs)
    return PreparedRequest([ids], params, body.stream, bool(body.stream_options and body.stream_options.include_usage),
                           body.logprobs, body.return_token_ids)

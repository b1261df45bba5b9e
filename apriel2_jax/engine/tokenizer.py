"""A small tokenizer wrapper over the ``tokenizers`` library (no ``transformers`` at run time).

    tok = Tokenizer.from_dir("path/to/checkpoint")       # tokenizer.json (+ tokenizer_config.json)
    ids = tok.encode("Hello")
    text = tok.decode(ids)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hello"}])

What is read from a checkpoint directory:

* ``tokenizer.json`` (required): vocabulary, normalizer, pre-tokenizer, model, post-processor and decoder.
* ``tokenizer_config.json`` (optional): ``bos_token`` / ``eos_token`` / ``unk_token`` / ``pad_token`` (plain
  strings, or HF ``AddedToken`` dicts with a ``"content"`` key), ``add_bos_token`` / ``add_eos_token`` and
  ``chat_template``.
* The chat template is taken from ``chat_template.jinja``, else ``chat_template.json``, else
  ``tokenizer_config.json`` (newer HF versions save it in a separate file). A list of named templates (HF's
  ``[{"name": ..., "template": ...}]`` form) resolves to the one named ``"default"``.

Chat templates are rendered as HF renders them: a sandboxed, immutable jinja2 environment with
``trim_blocks``/``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter that does not
HTML-escape, the globals ``raise_exception`` and ``strftime_now``, the special tokens as variables, and the
``{% generation %}`` block tag accepted (and rendered as its body).
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Any, Iterable, Mapping, Sequence

__all__ = ["Tokenizer", "TokenizerNotFound", "ChatTemplateError"]

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class TokenizerNotFound(FileNotFoundError):
    """The checkpoint directory has no ``tokenizer.json``."""

    def __init__(self, directory: str):
        self.directory = directory
        # No hint here: what to do instead depends on the caller (a flag of one command, an API field, a list of
        # ids in Python), which adds it.
        super().__init__(f"no {TOKENIZER_FILE} in {directory}: this checkpoint has no tokenizer")


class ChatTemplateError(ValueError):
    """The chat template is missing, invalid, or raised an error (``raise_exception``) while rendering."""


def _token_content(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a plain string, or an AddedToken dict with "content"."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _select_template(template: Any, source: str) -> str | None:
    if template is None:
        return None
    if isinstance(template, str):
        return template
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        chosen = named.get("default")
        if chosen is None and len(named) == 1:
            chosen = next(iter(named.values()))
        if isinstance(chosen, str):
            return chosen
        raise ChatTemplateError(f"{source}: chat_template lists {sorted(map(str, named))}, none named 'default'")
    raise ChatTemplateError(f"{source}: chat_template must be a string or a list of named templates")


class Tokenizer:
    def __init__(self, backend, config: Mapping[str, Any] | None = None, chat_template: str | None = None):
        """``backend`` is a ``tokenizers.Tokenizer``; ``config`` the contents of tokenizer_config.json."""
        self.backend = backend
        self.config = dict(config or {})
        self.chat_template = chat_template if chat_template is not None else _select_template(
            self.config.get("chat_template"), TOKENIZER_CONFIG_FILE
        )
        self.special_tokens: dict[str, str] = {}
        for key in _SPECIAL_TOKEN_KEYS:
            content = _token_content(self.config.get(key))
            if content is not None:
                self.special_tokens[key] = content
        self.add_bos_token = self.config.get("add_bos_token")
        self.add_eos_token = self.config.get("add_eos_token")
        self._compiled_template = None

    # ------------------------------------------------------------------------------------------------------------
    @classmethod
    def from_dir(cls, directory: str | os.PathLike) -> "Tokenizer":
        import tokenizers

        directory = os.fspath(directory)
        path = os.path.join(directory, TOKENIZER_FILE)
        if not os.path.isfile(path):
            raise TokenizerNotFound(directory)
        backend = tokenizers.Tokenizer.from_file(path)
        config: dict[str, Any] = {}
        config_path = os.path.join(directory, TOKENIZER_CONFIG_FILE)
        if os.path.isfile(config_path):
            with open(config_path, encoding="utf-8") as f:
                try:
                    config = json.load(f)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{config_path}: invalid JSON ({err})") from None
            if not isinstance(config, dict):
                raise ValueError(f"{config_path}: expected a JSON object")
        template = None
        jinja_path = os.path.join(directory, "chat_template.jinja")
        json_path = os.path.join(directory, "chat_template.json")
        if os.path.isfile(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                template = f.read()
        elif os.path.isfile(json_path):
            with open(json_path, encoding="utf-8") as f:
                template = _select_template(json.load(f).get("chat_template"), json_path)
        return cls(backend, config, template)

    # ------------------------------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self.token_to_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        """The id of ``eos_token`` (from tokenizer_config.json), or None when unknown."""
        return self.token_to_id(self.eos_token)

    # ------------------------------------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. With ``add_special_tokens`` the post-processor's special tokens are added, and
        ``add_bos_token`` / ``add_eos_token`` of tokenizer_config.json are honoured when they are set."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        ids = list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)
        if add_special_tokens:
            bos, eos = self.bos_token_id, self.eos_token_id
            if bos is not None:
                if self.add_bos_token is True and ids[:1] != [bos]:
                    ids.insert(0, bos)
                elif self.add_bos_token is False and ids[:1] == [bos] and not text.startswith(self.bos_token):
                    ids.pop(0)
            if eos is not None and self.add_eos_token is True and ids[-1:] != [eos]:
                ids.append(eos)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------------------------------------------------
    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def _template(self):
        if self._compiled_template is None:
            import jinja2
            from jinja2 import nodes
            from jinja2.ext import Extension, loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            class GenerationTag(Extension):
                # HF marks assistant turns with {% generation %}...{% endgeneration %}; render just the body.
                tags = {"generation"}

                def parse(self, parser):
                    lineno = next(parser.stream).lineno
                    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                    return nodes.Scope(body).set_lineno(lineno)

            def raise_exception(message):
                raise ChatTemplateError(f"chat template: {message}")

            def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
                return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                                  sort_keys=sort_keys)

            def strftime_now(fmt):
                return datetime.datetime.now().strftime(fmt)

            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols]
            )
            env.filters["tojson"] = tojson
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = strftime_now
            try:
                self._compiled_template = env.from_string(self.chat_template)
            except jinja2.TemplateError as err:
                raise ChatTemplateError(f"invalid chat template: {err}") from None
        return self._compiled_template

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` (``[{"role": ..., "content": ...}, ...]``) with the chat template. Encode the result
        with ``add_special_tokens=False``: the template writes the special tokens itself."""
        if not self.has_chat_template:
            raise ChatTemplateError("this tokenizer has no chat template")
        import jinja2

        template = self._template()
        variables: dict[str, Any] = {"tools": None, "documents": None}
        variables.update(self.special_tokens)
        variables.update(kwargs)
        variables["messages"] = [dict(m) for m in messages]
        variables["add_generation_prompt"] = add_generation_prompt
        try:
            return template.render(**variables)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as err:
            raise ChatTemplateError(f"chat template failed to render: {err}") from None

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, chat_template={self.has_chat_template})"


def with_end_of_turn(stop_ids: tuple[int, ...], tokenizer: Tokenizer | None, vocab_size: int,
                     model_eos: Sequence[int]) -> tuple[int, ...]:
    """``stop_ids`` plus the tokenizer's eos when it is a valid id that config.json's eos ids lack: a chat
    model's end-of-turn token is often the tokenizer's eos but not config.json's."""
    eos = tokenizer.eos_token_id if tokenizer is not None else None
    if eos is None or eos >= vocab_size or eos in model_eos or eos in stop_ids:
        return tuple(stop_ids)
    return tuple(stop_ids) + (eos,)

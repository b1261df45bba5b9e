"""Tests for apriel2_jax.engine.tokenizer: loading, encode/decode, special tokens and chat templates."""

from __future__ import annotations

import json
import os

import pytest

from apriel2_jax.engine.tokenizer import ChatTemplateError, Tokenizer, TokenizerNotFound

CORPUS = [
    "hello world",
    "hello there, how are you today?",
    "the quick brown fox jumps over the lazy dog",
    "world peace is a good idea",
    "user: what is the answer?\nassistant: the answer is here",
    "Pack my box with five dozen liquor jugs.",
    "system: be brief and kind",
] * 4

# user/assistant turns, the special tokens as variables, raise_exception for an unknown role.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}user: {{ m['content'] }}\n"
    "{% elif m['role'] == 'assistant' %}assistant: {{ m['content'] }}{{ eos_token }}\n"
    "{% else %}{{ raise_exception('unknown role ' + m['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def write_tiny_tokenizer(directory, vocab_size: int = 80, chat_template: str | None = CHAT_TEMPLATE,
                         config_overrides: dict | None = None) -> None:
    """A Metaspace BPE trained on CORPUS with <unk>=0, <s>=1, </s>=2 (the goldens' bos/eos ids), saved as
    tokenizer.json + tokenizer_config.json in ``directory``."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.decoder = decoders.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    assert tok.get_vocab_size() <= vocab_size
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    config = {
        # One token as a plain string, one as an HF AddedToken dict.
        "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": False, "rstrip": False},
        "eos_token": "</s>",
        "unk_token": "<unk>",
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    config.update(config_overrides or {})
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(directory)
    return directory


def test_encode_decode_round_trip(tok_dir):
    tok = Tokenizer.from_dir(tok_dir)
    assert tok.vocab_size == 80
    for text in ["hello world", "the lazy dog jumps over the brown fox", "how are you today?"]:
        ids = tok.encode(text)
        assert ids and all(isinstance(i, int) and 0 <= i < 80 for i in ids)
        assert tok.decode(ids) == text
    # Merges were learnt: a frequent word is one token, not one per character.
    assert len(tok.encode("hello")) == 1


def test_special_tokens_and_ids(tok_dir):
    tok = Tokenizer.from_dir(tok_dir)
    assert (tok.bos_token, tok.eos_token) == ("<s>", "</s>")  # dict form and string form
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    ids = tok.encode("hello world")
    assert 1 not in ids and 2 not in ids  # no post-processor and add_bos_token unset: nothing added
    assert tok.decode([1, *ids, 2]) == "hello world"
    assert tok.decode([1, *ids, 2], skip_special_tokens=False).startswith("<s>")


def test_add_bos_and_eos_token(tmp_path):
    write_tiny_tokenizer(tmp_path, config_overrides={"add_bos_token": True, "add_eos_token": True})
    tok = Tokenizer.from_dir(tmp_path)
    ids = tok.encode("hello world")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.encode("hello world", add_special_tokens=False) == ids[1:-1]
    assert tok.encode("<s>hello world")[:2] != [1, 1]  # an explicit BOS is not doubled


def test_chat_template_renders_like_hf(tok_dir):
    tok = Tokenizer.from_dir(tok_dir)
    assert tok.has_chat_template
    messages = [
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": "hello world"},
        {"role": "user", "content": "how are you?"},
    ]
    text = tok.apply_chat_template(messages)
    assert text == "<s>user: hello there\nassistant: hello world</s>\nuser: how are you?\nassistant:"
    assert tok.apply_chat_template(messages[:1], add_generation_prompt=False) == "<s>user: hello there\n"
    # Special tokens written by the template are recognised when encoding without post-processing.
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == 1 and ids.count(2) == 1
    assert tok.decode(ids) == text.replace("<s>", "").replace("</s>", "")


def test_chat_template_raise_exception(tok_dir):
    tok = Tokenizer.from_dir(tok_dir)
    with pytest.raises(ChatTemplateError, match="unknown role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_chat_template_sandbox_tojson_and_generation_tag(tmp_path):
    template = (
        "{% for m in messages %}{{ m | tojson }}{% generation %}[{{ m['role'] }}]{% endgeneration %}{% endfor %}"
    )
    write_tiny_tokenizer(tmp_path, chat_template=template)
    tok = Tokenizer.from_dir(tmp_path)
    out = tok.apply_chat_template([{"role": "user", "content": "<b>é</b>"}])
    assert out == '{"role": "user", "content": "<b>é</b>"}[user]'  # tojson neither HTML-escapes nor ASCII-escapes
    # The environment is sandboxed: no access to Python internals.
    write_tiny_tokenizer(tmp_path, chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):
        Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])
    write_tiny_tokenizer(tmp_path, chat_template="{% if %}")
    with pytest.raises(ChatTemplateError, match="invalid chat template"):
        Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])


def test_chat_template_sources(tmp_path):
    # A list of named templates picks "default"; chat_template.jinja overrides tokenizer_config.json.
    write_tiny_tokenizer(tmp_path, chat_template=[
        {"name": "tool_use", "template": "TOOLS"},
        {"name": "default", "template": "DEFAULT{{ messages[0]['content'] }}"},
    ])
    assert Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "hi"}]) == "DEFAULThi"
    (tmp_path / "chat_template.jinja").write_text("JINJA{{ eos_token }}")
    assert Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "hi"}]) == "JINJA</s>"


def test_no_chat_template(tmp_path):
    write_tiny_tokenizer(tmp_path, chat_template=None)
    tok = Tokenizer.from_dir(tmp_path)
    assert not tok.has_chat_template
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_tokenizer_config_is_optional(tmp_path):
    write_tiny_tokenizer(tmp_path)
    os.remove(tmp_path / "tokenizer_config.json")
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.decode(tok.encode("hello world")) == "hello world"
    assert tok.eos_token_id is None and not tok.has_chat_template


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(TokenizerNotFound) as info:
        Tokenizer.from_dir(tmp_path)
    assert isinstance(info.value, FileNotFoundError)
    message = str(info.value)
    # The caller adds what to do instead (a flag of its own command, an API field): no command's flag here.
    assert str(tmp_path) in message and "tokenizer.json" in message and "--" not in message

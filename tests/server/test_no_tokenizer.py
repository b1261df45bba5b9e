"""A model without a tokenizer (token ids only), served live: completions of token-id prompts return their token ids
unasked and carry log-probabilities whose offsets fit the (empty) text; chat and text prompts are refused with a 400
that says why. Also the translation of chat messages (missing content, tool and format fields), checked without a
server."""

from __future__ import annotations

import json
import os
import shutil

import httpx
import pytest

from apriel2_jax.engine.llm import LLM
from apriel2_jax.engine.tokenizer import Tokenizer
from apriel2_jax.server import BackgroundServer, create_app
from apriel2_jax.server.protocol import APIError, ChatCompletionRequest, EngineView, parse_body, prepare_chat
from tests.server.conftest import CASE, ENGINE, wait_until

MODEL = "ids-only"
IDS = {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 3, "logprobs": 0, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def ids_server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ids_ckpt")
    for name in ("config.json", "model.safetensors", "placements.json"):
        shutil.copy(os.path.join(CASE, name), directory / name)
    llm = LLM(str(directory), placement="mamba", tokenizer=None, **ENGINE)
    with BackgroundServer(create_app(llm, model_name=MODEL, max_queued_requests=8)) as running:
        yield running


def _events(response) -> list[dict]:
    data = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]", data[-3:]
    return [json.loads(d) for d in data[:-1]]


def test_logprob_offsets_fit_the_empty_text(ids_server):
    with httpx.Client(base_url=ids_server.url, timeout=300) as client:
        choice = client.post("/v1/completions", json=IDS).json()["choices"][0]
        lp = choice["logprobs"]
        # The tokens are placeholders ("token_id:46"), not text: every offset points into the empty text at 0.
        assert choice["text"] == "" and len(lp["tokens"]) == 3 and lp["tokens"][0].startswith("token_id:")
        assert lp["text_offset"] == [0, 0, 0]
        with client.stream("POST", "/v1/completions", json={**IDS, "stream": True}) as r:
            chunks = [e["choices"][0] for e in _events(r)]
        offsets = [o for c in chunks if c["logprobs"] for o in c["logprobs"]["text_offset"]]
        assert "".join(c["text"] for c in chunks) == "" and offsets == [0, 0, 0]


def test_token_ids_are_returned_without_asking(ids_server):
    with httpx.Client(base_url=ids_server.url, timeout=300) as client:
        choice = client.post("/v1/completions", json=IDS).json()["choices"][0]
        assert choice["text"] == "" and len(choice["token_ids"]) == 3, choice
        assert choice["prompt_token_ids"] == IDS["prompt"], choice
        with client.stream("POST", "/v1/completions", json={**IDS, "stream": True}) as r:
            chunks = [e["choices"][0] for e in _events(r)]
        assert [t for c in chunks for t in c.get("token_ids", [])] == choice["token_ids"], chunks


def test_chat_and_text_prompts_say_there_is_no_tokenizer(ids_server):
    with httpx.Client(base_url=ids_server.url, timeout=60) as client:
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "messages", error
        assert "no tokenizer" in error["message"] and "chat template" not in error["message"], error
        assert "/v1/completions" in error["message"] and "token-id" in error["message"], error
        r = client.post("/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 400 and "no tokenizer" in r.json()["error"]["message"]
    engine = ids_server.app.state.engine
    wait_until(lambda: engine.in_flight == 0, message="the requests to be released")


# ------------------------------------------------------------------------------------------------------------
# Missing message content (translation only)
# ------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def view(text_ckpt):
    return EngineView("m", 128, 512, (2,), Tokenizer.from_dir(text_ckpt))


def _chat(view, messages):
    return prepare_chat(parse_body(ChatCompletionRequest, json.dumps({"messages": messages}).encode()), view)


@pytest.mark.parametrize("messages, param", [
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "user", "content": None}], "messages[0].content"),
    ([{"role": "system"}, {"role": "user", "content": "hi"}], "messages[0].content"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant"}, {"role": "user", "content": "and?"}],
     "messages[1].content"),
])
def test_missing_content_is_refused(view, messages, param):
    with pytest.raises(APIError) as err:
        _chat(view, messages)
    assert err.value.status == 400 and err.value.param == param and err.value.message.startswith(param)


def test_assistant_tool_calls_may_omit_content(view):
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    prepared = _chat(view, [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [call]},
                            {"role": "user", "content": "and?"}])
    assert prepared.prompts[0]


def test_tool_and_format_fields_that_ask_for_nothing_are_accepted(view):
    tool = {"type": "function", "function": {"name": "f"}}
    for extra in ({"tool_choice": "none", "tools": [tool]}, {"tool_choice": "auto", "tools": []},
                  {"function_call": "none", "functions": [tool["function"]]}, {}):
        body = {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "text"}, **extra}
        assert prepare_chat(parse_body(ChatCompletionRequest, json.dumps(body).encode()), view).prompts[0]

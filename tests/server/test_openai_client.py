"""The real ``openai`` client against the live server: completions and chat, streamed and not, usage, stop
strings, log-probabilities (checked against the offline engine's) and seeds."""

from __future__ import annotations

import httpx
import openai
import pytest

from apriel2_jax.engine.sampling import SamplingParams
from tests.server.conftest import MODEL, engine_idle, wait_until

PROMPT = "the quick brown fox"
MESSAGES = [{"role": "user", "content": "hello there, how are you today?"}]


@pytest.fixture(scope="module")
def client(server):
    # No retries: a 429 or 5xx must reach the test, not be retried away.
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def tok(engine):
    return engine.llm.tokenizer


def offline(engine, prompt_ids, **params):
    """What LLM.generate gives for one prompt (run on the engine thread, between steps)."""
    return engine.call(lambda llm: llm.generate([prompt_ids], SamplingParams(**params))[0]).result(timeout=300)


def test_models(client):
    (model,) = client.models.list().data
    assert model.id == MODEL and model.owned_by == "apriel2-jax"


def test_completion_matches_offline_engine(client, engine, tok):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    prompt_ids = tok.encode(PROMPT)
    expected = offline(engine, prompt_ids, temperature=0.0, max_new_tokens=12, ignore_eos=True, logprobs=True)
    (choice,) = r.choices
    assert choice.token_ids == expected.token_ids and choice.prompt_token_ids == prompt_ids
    assert choice.text == expected.text and choice.finish_reason == "length"
    # abs: the offline run reuses the served request's cached prefix, which moves logits in the last float bits.
    assert choice.logprobs.token_logprobs == pytest.approx(expected.logprobs, abs=1e-4)
    assert len(choice.logprobs.tokens) == 12 and "".join(choice.logprobs.tokens) == choice.text
    assert r.usage.prompt_tokens == len(prompt_ids) and r.usage.completion_tokens == 12
    assert r.usage.total_tokens == len(prompt_ids) + 12
    assert r.model == MODEL and r.object == "text_completion" and r.id.startswith("cmpl-")


def test_completion_stream_concatenates_to_the_whole(client):
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0, logprobs=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**args)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    *body, usage = chunks
    assert usage.choices == [] and usage.usage.completion_tokens == 20
    assert usage.usage.prompt_tokens == whole.usage.prompt_tokens
    assert "".join(c.choices[0].text for c in body) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in body] == [None] * (len(body) - 1) + ["length"]
    streamed = [lp for c in body if c.choices[0].logprobs for lp in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(whole.choices[0].logprobs.token_logprobs, abs=1e-4)


def test_chat_applies_the_template(client, engine, tok):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0, logprobs=True,
                                       extra_body={"ignore_eos": True})
    prompt_ids = tok.encode(tok.apply_chat_template(MESSAGES), add_special_tokens=False)
    assert tok.decode(prompt_ids).endswith("assistant:")
    expected = offline(engine, prompt_ids, temperature=0.0, max_new_tokens=10, ignore_eos=True, logprobs=True)
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.message.content == expected.text
    assert [t.logprob for t in choice.logprobs.content] == pytest.approx(expected.logprobs, abs=1e-4)
    assert r.usage.prompt_tokens == len(prompt_ids) and r.usage.completion_tokens == 10
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")


def test_chat_stream(client):
    args = dict(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(stream=True, **args))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_the_text(client, stream):
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**args).choices[0].text
    stop = full[6:9]
    assert len(stop) == 3 and stop.strip(), full
    if stream:
        chunks = list(client.completions.create(stop=[stop], stream=True, **args))
        text, reason = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
    else:
        choice = client.completions.create(stop=stop, **args).choices[0]
        text, reason = choice.text, choice.finish_reason
    assert text == full[: full.find(stop)] and reason == "stop"


def test_seed_reproduces_sampling(client):
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.0,
                extra_body={"ignore_eos": True, "return_token_ids": True})
    ids = lambda seed: client.completions.create(seed=seed, **args).choices[0].token_ids  # noqa: E731
    first = ids(1234)
    assert ids(1234) == first
    assert ids(4321) != first  # 16 draws over 128 tokens: equal only by a (negligible) coincidence


def test_errors_reach_the_client(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=-1)
    assert err.value.body["param"] == "temperature" and err.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4", messages=MESSAGES)
    assert err.value.body["param"] == "model" and err.value.body["code"] == "model_not_found"


def test_health_and_idle_afterwards(server, engine):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    wait_until(lambda: engine_idle(engine), message="the engine to drain")

"""Tests for the ``apriel2-generate`` command line (apriel2_jax/cli/generate.py).

Engine runs are kept few and small (compilation dominates on CPU): one subprocess run of the installed console
script against a golden case, and two in-process runs with a tokenizer trained in the test. Error cases stop
before any compilation.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout

import pytest

from apriel2_jax.cli.generate import _print_output, main, read_prompts_file, UsageError
from apriel2_jax.engine.llm import RequestOutput
from apriel2_jax.engine.tokenizer import Tokenizer
from apriel2_jax.safetensors_io import read_header, read_tensor
from tests.conftest import GOLDENS
from tests.engine.test_tokenizer import write_tiny_tokenizer

CASE = os.path.join(GOLDENS, "supernet_swa")
# Small engine: few, small buckets to compile.
ENGINE = ["--max-num-seqs", "2", "--max-num-batched-tokens", "16", "--max-chunk", "16", "--max-prefill-rows", "2",
          "--page-size", "4", "--dtype", "float32", "--warm-up", "none"]


def _console_script() -> list[str]:
    script = os.path.join(os.path.dirname(sys.executable), "apriel2-generate")
    if os.path.exists(script):
        return [script]
    found = shutil.which("apriel2-generate")
    return [found] if found else [sys.executable, "-m", "apriel2_jax.cli.generate"]


def test_golden_greedy_through_console_script():
    infos, metadata = read_header(os.path.join(CASE, "golden.safetensors"))
    prompt_len = int(metadata["prompt_len"])
    prompts = read_tensor(infos["input_ids"])[:, :prompt_len]
    expected = read_tensor(infos["main.greedy_ids"]).tolist()
    argv = [*_console_script(), CASE, "--placement", "main", "--max-new-tokens", "8", "--ignore-eos", "--json", *ENGINE]
    for row in prompts:
        argv += ["--prompt-ids", ",".join(str(int(t)) for t in row)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    records = json.loads(proc.stdout)  # stdout holds the JSON document and nothing else
    assert [r["index"] for r in records] == [0, 1]
    assert [r["prompt_ids"] for r in records] == prompts.tolist()
    assert [r["token_ids"] for r in records] == expected
    assert all(r["finish_reason"] == "length" and r["text"] is None and r["logprobs"] is None for r in records)
    assert all(0 < r["time_to_first_token"] <= r["total_time"] for r in records)
    assert "tokens/s" in proc.stderr and "cache peak" in proc.stderr


def _golden_pairs():
    """One placement per golden case, the last listed (supernet_swa's "main" is the console-script test's). Every
    placement's greedy tokens are checked through the engine in tests/engine/test_llm.py; this covers the CLI's
    path (checkpoint directory, --placement, --json) on each case."""
    from tests.conftest import golden_cases

    pairs = []
    for case in golden_cases():
        with open(os.path.join(GOLDENS, case, "placements.json")) as f:
            pairs.append((case, list(json.load(f))[-1]))
    return pairs


@pytest.mark.parametrize("case, placement", _golden_pairs())
def test_golden_greedy_every_case(case, placement):
    """The goldens through the CLI in-process (the console script itself is exercised above)."""
    directory = os.path.join(GOLDENS, case)
    infos, metadata = read_header(os.path.join(directory, "golden.safetensors"))
    prompts = read_tensor(infos["input_ids"])[:, : int(metadata["prompt_len"])]
    argv = [directory, "--placement", placement, "--max-new-tokens", "8", "--ignore-eos", "--json", *ENGINE]
    for row in prompts:
        argv += ["--prompt-ids", ",".join(str(int(t)) for t in row)]
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(argv)
    assert code == 0, err.getvalue()
    tokens = [r["token_ids"] for r in json.loads(out.getvalue())]
    assert tokens == read_tensor(infos[f"{placement}.greedy_ids"]).tolist()


@pytest.fixture(scope="module")
def text_ckpt(tmp_path_factory):
    """The supernet_swa checkpoint (vocab 80) with a trained 80-token tokenizer and a chat template."""
    directory = tmp_path_factory.mktemp("ckpt")
    for name in ("config.json", "model.safetensors", "placements.json"):
        shutil.copy(os.path.join(CASE, name), directory / name)
    write_tiny_tokenizer(directory, vocab_size=80)
    return str(directory)


@pytest.fixture(scope="module")
def json_run(text_ckpt):
    """One --json run with a text prompt (chat template applied by default); shared by two tests (capsys is
    function-scoped, so the output is captured by hand)."""
    out, err = io.StringIO(), io.StringIO()
    argv = [text_ckpt, "--prompt", "hello world", "--max-new-tokens", "12", "--ignore-eos", "--logprobs", "--json",
            *ENGINE]
    with redirect_stdout(out), redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def test_text_prompt_json(json_run, text_ckpt):
    code, stdout, stderr = json_run
    assert code == 0, stderr
    (record,) = json.loads(stdout)
    tok = Tokenizer.from_dir(text_ckpt)
    rendered = tok.apply_chat_template([{"role": "user", "content": "hello world"}])
    assert rendered == "<s>user: hello world\nassistant:"
    assert record["prompt_ids"] == tok.encode(rendered, add_special_tokens=False)
    assert len(record["token_ids"]) == 12 and record["finish_reason"] == "length"
    assert record["text"] == tok.decode(record["token_ids"]) and len(record["text"]) >= 3
    assert len(record["logprobs"]) == 12 and all(lp <= 0 for lp in record["logprobs"])
    assert "tokens/s" in stderr and "prefill" in stderr and "decode" in stderr and "cache peak" in stderr
    assert re.search(r"\d+ decode dispatches, \d+ chained", stderr)


def test_llm_loads_the_checkpoint_tokenizer_by_default(text_ckpt):
    from apriel2_jax.engine.llm import LLM

    small = dict(max_num_seqs=2, max_num_batched_tokens=16, max_chunk=16, page_size=4, warm_up="none",
                 cache_bytes=2**20, compilation_cache="off")
    logged = []
    llm = LLM(text_ckpt, max_model_len=1024, log=logged.append, **small)
    assert llm.tokenizer is not None and llm.tokenizer.encode("hello") == Tokenizer.from_dir(text_ckpt).encode("hello")
    # Past the model's trained positions (512): allowed, with a warning naming both numbers.
    assert any("warning" in m and "1024" in m and "512" in m for m in logged), logged
    assert LLM(text_ckpt, tokenizer=None, log=logged.append, **small).tokenizer is None
    no_tokenizer = LLM(CASE, log=logged.append, **small)
    assert no_tokenizer.tokenizer is None
    with pytest.raises(ValueError, match="no tokenizer"):
        no_tokenizer.generate(["hello"])


def test_text_prompt_streams_and_stops(json_run, text_ckpt, capsys):
    """Streaming output of the same prompt, cut at a stop string taken from the middle of the full text."""
    full = json.loads(json_run[1])[0]["text"]
    k = next(i for i in range(len(full) // 2, len(full) - 1) if full.find(full[i:i + 2]) == i)
    stop = full[k:k + 2]
    code = main([text_ckpt, "--prompt", "hello world", "--max-new-tokens", "12", "--ignore-eos", "--stop", stop,
                 *ENGINE])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert captured.out == full[:k] + "\n"  # never printed the start of the stop string
    assert "finish: stop 1" in captured.err and "tokens/s" in captured.err


# ------------------------------------------------------------------------------------------------------------
# Errors: exit status 2, a message on stderr, no traceback; none of these gets as far as compiling.
# ------------------------------------------------------------------------------------------------------------


def _fails(capsys, argv, *needles):
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, err
    return err


def test_text_prompt_without_tokenizer(capsys):
    _fails(capsys, [CASE, "--prompt", "hello", *ENGINE], "tokenizer", "--prompt-ids")


def test_stop_string_without_tokenizer(capsys):
    _fails(capsys, [CASE, "--prompt-ids", "1,2", "--stop", "x", *ENGINE], "--stop", "tokenizer", "--stop-token-ids")


@pytest.mark.parametrize("flag,value", [
    ("--temperature", "-1"),
    ("--temperature", "nan"),
    ("--top-p", "0"),
    ("--top-k", "-2"),
    ("--max-new-tokens", "0"),
    ("--seed", "-1"),
])
def test_bad_sampling_values(capsys, flag, value):
    # No engine flags: sampling values are checked before anything is loaded, and named by their flag.
    err = _fails(capsys, [CASE, "--prompt-ids", "1,2", flag, value], flag, value)
    assert "SamplingParams" not in err


@pytest.mark.parametrize("flag,value", [
    ("--max-model-len", "0"),  # was silently the model's default
    ("--max-model-len", "-5"),
    ("--tensor-parallel", "0"),
    ("--max-num-seqs", "0"),
    ("--page-size", "-1"),
    ("--decode-steps", "0"),
    ("--kv-load-timeout", "0"),
    ("--cache-memory-fraction", "1.5"),
    ("--snapshot-memory-fraction", "1"),
    ("--snapshot-interval", "-16"),
])
def test_bad_engine_values_name_their_flag(capsys, flag, value):
    _fails(capsys, [CASE, "--prompt-ids", "1,2", flag, value], f"argument {flag}", repr(value))


def test_engine_errors_name_flags_not_keyword_arguments(capsys):
    # A constraint between two flags, checked by the engine: reported with the flags' names.
    err = _fails(capsys, [CASE, "--prompt-ids", "1,2", "--max-num-batched-tokens", "8", "--max-chunk", "16",
                          "--warm-up", "none"], "--max-chunk=16", "--max-num-batched-tokens=8")
    assert "max_chunk" not in err


def test_flag_names_replace_whole_keyword_arguments_only():
    from apriel2_jax.cli.engine_args import with_flag_names

    assert with_flag_names("max_chunk=16 exceeds max_num_batched_tokens=8; lower max_chunk") == (
        "--max-chunk=16 exceeds --max-num-batched-tokens=8; lower --max-chunk")
    assert with_flag_names("kv_connector needs enable_prefix_caching=True") == "--kv-connector needs --prefix-caching"
    # Not inside longer names, attribute paths or file paths.
    assert with_flag_names("a.dtype, /ckpt/page_size/x, page_sizes, my_max_chunk") == (
        "a.dtype, /ckpt/page_size/x, page_sizes, my_max_chunk")


def test_unusable_directories_are_usage_errors(capsys, tmp_path):
    a_file = tmp_path / "afile"
    a_file.write_text("x")
    _fails(capsys, [CASE, "--prompt-ids", "1,2", "--kv-connector", "disk", "--kv-connector-path", str(a_file),
                    *ENGINE], "--kv-connector-path", str(a_file))
    _fails(capsys, [CASE, "--prompt-ids", "1,2", "--compilation-cache", str(a_file / "cache"), *ENGINE],
           "--compilation-cache", "cannot create")


def test_bad_prompt_ids(capsys):
    _fails(capsys, [CASE, "--prompt-ids", "1,x"], "--prompt-ids", "'x'")
    _fails(capsys, [CASE, "--prompt-ids", " , "], "--prompt-ids")
    _fails(capsys, [CASE, "--prompt-ids", "1,,2"], "--prompt-ids", "empty entry")  # a lost id, not [1, 2]
    _fails(capsys, [CASE, "--prompt-ids", "1,-3"], "negative")
    _fails(capsys, [CASE, "--prompt-ids", "1,80", *ENGINE], "outside the vocabulary")


def test_prompt_longer_than_context(capsys):
    _fails(capsys, [CASE, "--prompt-ids", "1,2,3,4,5,6,7,8", "--max-model-len", "8", *ENGINE],
           "max_model_len", "8 tokens")


def test_prompt_near_the_context_end_warns_and_stops_there(capsys):
    argv = [CASE, "--prompt-ids", "1,2,3,4,5,6", "--max-model-len", "8", "--max-new-tokens", "5", "--ignore-eos",
            "--json", *ENGINE]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "warning: prompt 0 has 6 tokens, so the context (max_model_len 8) leaves room for 2 of the 5" in captured.err
    (record,) = json.loads(captured.out)
    assert len(record["token_ids"]) == 2 and record["finish_reason"] == "length"


def test_unknown_placement(capsys):
    _fails(capsys, [CASE, "--prompt-ids", "1,2", "--placement", "nope", *ENGINE], "unknown placement 'nope'", "main")
    _fails(capsys, [CASE, "--prompt-ids", "1,2", "--placement", "attention,kda,gdn", *ENGINE], "unknown mixer 'kda'")


def test_missing_checkpoint(capsys, tmp_path):
    _fails(capsys, [str(tmp_path / "nowhere"), "--prompt-ids", "1,2"], "does not exist")
    _fails(capsys, [str(tmp_path), "--prompt-ids", "1,2"], "config.json")


def test_no_prompt(capsys):
    _fails(capsys, [CASE, *ENGINE], "no prompt")


def test_chat_template_requested_but_missing(capsys, tmp_path):
    for name in ("config.json", "placements.json"):
        shutil.copy(os.path.join(CASE, name), tmp_path / name)
    write_tiny_tokenizer(tmp_path, chat_template=None)
    _fails(capsys, [str(tmp_path), "--prompt", "hello", "--chat-template"], "no chat template")


# ------------------------------------------------------------------------------------------------------------
# Pieces that need no engine
# ------------------------------------------------------------------------------------------------------------


def test_prompts_file_text_and_jsonl(tmp_path):
    plain = tmp_path / "p.txt"
    plain.write_text("hello world\n\nthe lazy dog\n")
    assert read_prompts_file(str(plain)) == [("text", "hello world"), ("text", "the lazy dog")]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "hello", "id": 7}\n{"prompt": [1, 2, 3]}\n')
    assert read_prompts_file(str(jsonl)) == [("text", "hello"), ("ids", [1, 2, 3])]
    jsonl.write_text('{"prompt": "hello"}\n{"text": "no prompt field"}\n')
    with pytest.raises(UsageError, match="line 2"):
        read_prompts_file(str(jsonl))
    with pytest.raises(UsageError, match="cannot read"):
        read_prompts_file(str(tmp_path / "missing.txt"))
    # A first line meant as JSON but broken is an error, not a text prompt of its characters.
    jsonl.write_text('{"prompt": [1, 2\n')
    with pytest.raises(UsageError, match="line 1: starts with '{' but is not valid JSON"):
        read_prompts_file(str(jsonl))


def test_prompts_file_errors_reach_the_user(capsys, tmp_path):
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": [1, "x"]}\n')
    _fails(capsys, [CASE, "--prompts-file", str(bad)], "line 1", "prompt")


def test_several_outputs_are_printed_with_their_index(capsys):
    out = RequestOutput(index=3, prompt_ids=[1], token_ids=[5, 6], text=None, finish_reason="length",
                        logprobs=[-0.5, -1.25], preemptions=[], time_to_first_token=0.1, total_time=0.2)
    _print_output(sys.stdout, out, has_tokenizer=False, logprobs=True)
    _print_output(sys.stdout, RequestOutput(**{**out.__dict__, "text": "hi there"}), has_tokenizer=True,
                  logprobs=False)
    assert capsys.readouterr().out == "[3] 5 6\n[3] logprobs: -0.5000 -1.2500\n[3] hi there\n"


def test_prefix_caching_flag_and_summary():
    """A prompt sent twice: the second run hits the first's pages and snapshots (the summary says how many
    tokens were saved: the first ends a chunk at the last page boundary before the end, where its prefix stops
    being shared with the queued copy); --no-prefix-caching gives the same tokens and no prefix-cache line."""
    directory = os.path.join(GOLDENS, "hybrid_all_mixers")
    infos, metadata = read_header(os.path.join(directory, "golden.safetensors"))
    prompt = ",".join(str(int(t)) for t in read_tensor(infos["input_ids"])[0, : int(metadata["prompt_len"])])
    runs = {}
    for flag in ("--prefix-caching", "--no-prefix-caching"):
        argv = [directory, "--placement", "mamba", "--max-new-tokens", "4", "--ignore-eos", "--json", *ENGINE,
                "--max-num-seqs", "1", "--max-chunk", "8", "--prompt-ids", prompt, "--prompt-ids", prompt, flag]
        out, err = io.StringIO(), io.StringIO()
        with redirect_stdout(out), redirect_stderr(err):
            assert main(argv) == 0, err.getvalue()
        runs[flag] = ([r["token_ids"] for r in json.loads(out.getvalue())], err.getvalue())
    (cached, log), (plain, plain_log) = runs["--prefix-caching"], runs["--no-prefix-caching"]
    assert cached == plain and cached[0] == cached[1]
    line = next(line for line in log.splitlines() if line.startswith("prefix cache:"))
    saved = (int(metadata["prompt_len"]) - 1) // 4 * 4  # pages of 4; at least one token is recomputed
    assert f"; {saved} prefill tokens saved" in line and "state" in line
    assert "prefix cache:" not in plain_log


def test_kv_connector_flags_disk_store_reused_by_a_second_run(tmp_path):
    """--kv-connector disk: the first run saves its prefix to the directory, a second run (a fresh engine)
    loads it and says so in the summary; the tokens do not change. Flag mistakes are usage errors."""
    directory = os.path.join(GOLDENS, "hybrid_all_mixers")
    infos, metadata = read_header(os.path.join(directory, "golden.safetensors"))
    prompt = ",".join(str(int(t)) for t in read_tensor(infos["input_ids"])[0, : int(metadata["prompt_len"])])
    store = str(tmp_path / "kv")
    base = [directory, "--placement", "mamba", "--max-new-tokens", "4", "--ignore-eos", "--json", *ENGINE,
            "--max-num-seqs", "1", "--max-chunk", "8", "--prompt-ids", prompt]
    runs = []
    for _ in range(2):
        out, err = io.StringIO(), io.StringIO()
        with redirect_stdout(out), redirect_stderr(err):
            assert main(base + ["--kv-connector", "disk", "--kv-connector-path", store]) == 0, err.getvalue()
        runs.append(([r["token_ids"] for r in json.loads(out.getvalue())], err.getvalue()))
    assert runs[0][0] == runs[1][0]
    first = next(line for line in runs[0][1].splitlines() if line.startswith("kv connector:"))
    second = next(line for line in runs[1][1].splitlines() if line.startswith("kv connector:"))
    saved = re.search(r"; (\d+) tokens and (\d+) state snapshots saved", first)
    assert first.startswith("kv connector: 0 of 0 claimed") and saved and min(map(int, saved.groups())) > 0
    assert second.startswith("kv connector: 16 of 16 claimed prefix tokens loaded")
    for flags, message in (
        (["--kv-connector", "disk"], "--kv-connector disk needs --kv-connector-path"),
        (["--kv-connector", "host"], "--kv-connector host needs --kv-connector-bytes"),
        (["--kv-connector-path", store], "--kv-connector-path needs --kv-connector host or disk"),
        (["--kv-connector", "host", "--kv-connector-bytes", "1G", "--no-prefix-caching"], "needs prefix caching"),
    ):
        err = io.StringIO()
        with redirect_stdout(io.StringIO()), redirect_stderr(err):
            assert main(base + flags) == 2
        assert message in err.getvalue(), err.getvalue()
    err = io.StringIO()
    with redirect_stderr(err):
        assert main(base + ["--kv-connector-bytes", "lots"]) == 2
    assert "expected a size such as 512M" in err.getvalue()

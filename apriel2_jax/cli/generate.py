"""``apriel2-generate CHECKPOINT_DIR [options]``: generate text (or token ids) with the serving engine.

    apriel2-generate ckpt --prompt "Hello" --max-new-tokens 32               # streams the text to stdout
    apriel2-generate ckpt --prompts-file prompts.jsonl --temperature 0.7 --json
    apriel2-generate goldens/supernet_swa --prompt-ids "5,7,9" --placement main --dtype float32

Generated text goes to stdout (streamed when there is one prompt; one "[index] text" block per finished
request when there are several; token ids when the checkpoint has no tokenizer). ``--json`` prints a single
JSON list instead and nothing else on stdout. Engine messages and the final throughput/cache summary go to
stderr. Usage errors, bad sampling values, missing files and over-long prompts exit with status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import sys
import time

from .engine_args import (add_distributed_arguments, add_engine_arguments, add_model_arguments, engine_kwargs,
                          join_processes, number_type, parse_placement, positive_int, with_flag_names)

PROG = "apriel2-generate"


class UsageError(Exception):
    """A problem with the command line or its inputs: reported on stderr, exit status 2."""


# ------------------------------------------------------------------------------------------------------------
# Argument parsing
# ------------------------------------------------------------------------------------------------------------


def parse_token_ids(text: str) -> list[int]:
    """``"1,2,3"`` (commas and/or whitespace) -> ``[1, 2, 3]``; raises UsageError naming the bad entry."""
    if not text.strip():
        raise UsageError(f"{text!r} holds no token ids; expected integers like \"1,2,3\"")
    parts = re.split(r"\s*,\s*|\s+", text.strip())
    ids = []
    for part in parts:
        if not part:  # "1,,2" or a trailing comma: most likely a lost id, not a separator to skip
            raise UsageError(f"{text!r} has an empty entry between commas; expected token ids like \"1,2,3\"")
        try:
            value = int(part)
        except ValueError:
            raise UsageError(f"{part!r} in {text!r} is not an integer; expected token ids like \"1,2,3\"") from None
        if value < 0:
            raise UsageError(f"{value} in {text!r} is negative; token ids are >= 0")
        ids.append(value)
    return ids


def _ids_arg(text: str) -> list[int]:
    try:
        return parse_token_ids(text)
    except UsageError as err:  # argparse reports it as "argument --prompt-ids: ..." with exit status 2
        raise argparse.ArgumentTypeError(str(err)) from None


class _AppendSource(argparse.Action):
    """Append ``(kind, value)`` to one shared list so prompts keep their command-line order across flags."""

    def __call__(self, parser, namespace, values, option_string=None):
        sources = list(getattr(namespace, self.dest) or [])
        sources.append((self.const, values))
        setattr(namespace, self.dest, sources)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Generate with an Apriel2 checkpoint on the apriel2-jax serving engine.",
        epilog="Errors (bad flags or values, missing files, prompts longer than the context) exit with status 2.",
    )
    parser.add_argument("checkpoint_dir", metavar="CHECKPOINT_DIR",
                        help="HF checkpoint directory (config.json, safetensors, optional tokenizer.json, placements.json)")

    g = parser.add_argument_group("prompts (at least one; they keep their command-line order)")
    g.add_argument("--prompt", dest="sources", action=_AppendSource, const="text", metavar="TEXT",
                   help="a text prompt (repeatable); needs the checkpoint's tokenizer")
    g.add_argument("--prompts-file", dest="sources", action=_AppendSource, const="file", metavar="PATH",
                   help="one text prompt per line, or JSONL lines {\"prompt\": TEXT or [ids]} (blank lines skipped)")
    g.add_argument("--prompt-ids", dest="sources", action=_AppendSource, const="ids", type=_ids_arg,
                   metavar="IDS", help="a prompt as token ids, e.g. \"1,2,3\" (repeatable); works without a tokenizer")
    g.add_argument("--chat-template", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap each text prompt as one user message with the tokenizer's chat template "
                        "(default: when the tokenizer has one)")

    add_model_arguments(parser)

    g = parser.add_argument_group("sampling")
    g.add_argument("--temperature", type=number_type(float, 0.0), default=0.0, help="0 (default) is greedy")
    g.add_argument("--top-k", type=number_type(int, -1), default=0,
                   help="keep the k most likely tokens (0 or -1: off)")
    g.add_argument("--top-p", type=number_type(float, 0.0, 1.0, low_open=True), default=1.0,
                   help="nucleus sampling mass in (0, 1] (1: off)")
    g.add_argument("--seed", type=int, default=None,
                   help="seed of the run (default 0): each prompt samples from its own stream derived from it")
    g.add_argument("--max-new-tokens", type=positive_int, default=64, help="default 64")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop at this string, cut from the output (repeatable; needs a tokenizer)")
    g.add_argument("--stop-token-ids", type=_ids_arg, default=[], metavar="IDS",
                   help="stop after any of these token ids, e.g. \"7,9\"")
    g.add_argument("--ignore-eos", action="store_true",
                   help="do not stop at the model's (or the tokenizer's) end-of-sequence token")
    g.add_argument("--logprobs", action="store_true", help="report the log-probability of each generated token")

    add_engine_arguments(parser)
    add_distributed_arguments(parser)

    g = parser.add_argument_group("output")
    g.add_argument("--json", action="store_true",
                   help="print one JSON list of {index, prompt_ids, token_ids, text, finish_reason, logprobs, "
                        "time_to_first_token, total_time} to stdout, and nothing else there")
    return parser


# ------------------------------------------------------------------------------------------------------------
# Prompts
# ------------------------------------------------------------------------------------------------------------


def read_prompts_file(path: str) -> list[tuple[str, object]]:
    """``[(kind, value)]`` from a prompts file: JSONL (every non-blank line a JSON object with "prompt": a string
    or a list of token ids) when its first non-blank line is a JSON object, else one text prompt per line."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as err:
        raise UsageError(f"--prompts-file: cannot read {path}: {err.strerror or err}") from None
    numbered = [(n, line) for n, line in enumerate(lines, start=1) if line.strip()]
    if not numbered:
        raise UsageError(f"--prompts-file: {path} holds no prompts")

    def as_object(line: str):
        if not line.lstrip().startswith("{"):
            return None
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            return None
        return value if isinstance(value, dict) else None

    first_n, first = numbered[0]
    if as_object(first) is None:
        if first.lstrip().startswith("{"):  # meant as JSONL, most likely: a broken line must not become a prompt
            try:
                json.loads(first)
            except json.JSONDecodeError as err:
                raise UsageError(f"--prompts-file {path}, line {first_n}: starts with '{{' but is not valid JSON "
                                 f"({err.msg}, column {err.colno}); write JSONL lines {{\"prompt\": TEXT or [ids]}} "
                                 "(also for a text prompt that starts with '{')") from None
        return [("text", line) for _, line in numbered]
    prompts: list[tuple[str, object]] = []
    for n, line in numbered:
        obj = as_object(line)
        where = f"--prompts-file {path}, line {n}"
        if obj is None:
            raise UsageError(f"{where}: not a JSON object (the file is read as JSONL since its first line is one)")
        if "prompt" not in obj:
            raise UsageError(f"{where}: no \"prompt\" field")
        prompt = obj["prompt"]
        if isinstance(prompt, str):
            prompts.append(("text", prompt))
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
            prompts.append(("ids", list(prompt)))
        else:
            raise UsageError(f"{where}: \"prompt\" must be a string or a list of token ids >= 0")
    return prompts


def collect_prompts(sources) -> list[tuple[str, object]]:
    prompts: list[tuple[str, object]] = []
    for kind, value in sources or []:
        if kind == "file":
            prompts.extend(read_prompts_file(value))
        else:
            prompts.append((kind, value))
    return prompts


def encode_prompts(prompts, tokenizer, use_chat_template: bool) -> list[list[int]]:
    """Token ids of every prompt. Text prompts wrapped by the chat template are encoded without the
    post-processor's special tokens (the template writes them), as HF's ``apply_chat_template`` does."""
    encoded = []
    for kind, value in prompts:
        if kind == "ids":
            encoded.append(list(value))
        elif use_chat_template:
            text = tokenizer.apply_chat_template([{"role": "user", "content": value}], add_generation_prompt=True)
            encoded.append(tokenizer.encode(text, add_special_tokens=False))
        else:
            encoded.append(tokenizer.encode(value))
    return encoded


# ------------------------------------------------------------------------------------------------------------
# Output
# ------------------------------------------------------------------------------------------------------------


def _ids_text(ids) -> str:
    return " ".join(str(i) for i in ids)


class _Streamer:
    """Writes one request's text to stdout as it arrives.

    Text is printed only up to a safe point: a trailing U+FFFD (a multi-byte character split across tokens)
    and the last ``max(len(stop)) - 1`` characters (the start of a stop string that may still complete) wait
    for later tokens. The final text of the request (stop strings cut) completes the line.
    """

    def __init__(self, out, tokenizer, stop: tuple[str, ...]):
        self.out = out
        self.tokenizer = tokenizer
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []
        self.printed = ""

    def _write(self, text: str) -> None:
        if text:
            self.out.write(text)
            self.out.flush()

    def update(self, event) -> None:
        if self.tokenizer is None:
            if event.new_token_ids:
                self._write(("" if not self.ids else " ") + _ids_text(event.new_token_ids))
            self.ids.extend(event.new_token_ids)
            return
        self.ids.extend(event.new_token_ids)
        if event.finished:
            final = event.output.text or ""
            if final.startswith(self.printed):
                self._write(final[len(self.printed):])
            self.printed = final
            return
        text = self.tokenizer.decode(self.ids)
        safe = text.rstrip("\ufffd")
        safe = safe[: max(0, len(safe) - self.holdback)]
        if safe.startswith(self.printed) and len(safe) > len(self.printed):
            self._write(safe[len(self.printed):])
            self.printed = safe

    def finish(self, output, logprobs: bool) -> None:
        self._write("\n")
        if logprobs and output.logprobs is not None:
            self._write("logprobs: " + " ".join(f"{lp:.4f}" for lp in output.logprobs) + "\n")


def _print_output(out, output, has_tokenizer: bool, logprobs: bool) -> None:
    body = output.text if has_tokenizer else _ids_text(output.token_ids)
    out.write(f"[{output.index}] {body}\n")
    if logprobs and output.logprobs is not None:
        out.write(f"[{output.index}] logprobs: " + " ".join(f"{lp:.4f}" for lp in output.logprobs) + "\n")
    out.flush()


def output_record(output) -> dict:
    return {
        "index": output.index,
        "prompt_ids": list(output.prompt_ids),
        "token_ids": list(output.token_ids),
        "text": output.text,
        "finish_reason": output.finish_reason,
        "logprobs": output.logprobs,
        "time_to_first_token": output.time_to_first_token,
        "total_time": output.total_time,
    }


def summary_lines(llm, outputs, wall: float, warmed_up: bool) -> list[str]:
    stats = llm.stats
    reasons: dict[str, int] = {}
    for o in outputs:
        reasons[o.finish_reason] = reasons.get(o.finish_reason, 0) + 1
    generated = sum(len(o.token_ids) for o in outputs)
    lines = [
        f"{len(outputs)} request(s), {sum(len(o.prompt_ids) for o in outputs)} prompt tokens, {generated} generated "
        f"tokens in {wall:.2f} s (finish: {', '.join(f'{k} {v}' for k, v in sorted(reasons.items())) or '-'})",
        f"prefill: {stats.prefill_tokens} tokens in {stats.prefill_seconds:.2f} s = "
        f"{stats.prefill_tokens_per_second:.1f} tokens/s; decode: {stats.decode_tokens} tokens in "
        f"{stats.decode_seconds:.2f} s = {stats.decode_tokens_per_second:.1f} tokens/s; {stats.steps} steps "
        f"({stats.decode_dispatches} decode dispatches, {stats.chained_dispatches} chained; "
        f"{stats.chained_prefills} prefill steps chained)"
        + ("" if warmed_up else " (compilation of shapes not warmed up included)"),
    ]
    usage = llm.cache_manager.usage()
    parts = []
    for family, (_, capacity) in usage.items():
        peak = stats.peak_usage.get(family, 0)
        unit = "slots" if family == "state" else f"pages of {llm.plan.page_size} tokens"
        share = f" ({100.0 * peak / capacity:.1f}%)" if capacity else ""
        parts.append(f"{family} {peak}/{capacity} {unit}{share}")
    lines.append("cache peak: " + ("; ".join(parts) if parts else "no cache"))
    if llm.prefix_cache is not None:
        lines.append(f"{stats.prefix.summary()}; {stats.prefix.hit_tokens} prefill tokens saved")
    if stats.connector is not None:
        lines.append(stats.connector.summary())
    if stats.preemptions:
        lines.append(f"preemptions: {stats.preemptions}")
    return lines


# ------------------------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse already printed usage and the message (or --help)
        return exit_.code if isinstance(exit_.code, int) else 2
    try:
        return _run(args)
    except UsageError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


def _run(args) -> int:
    directory = args.checkpoint_dir
    if not args.sources:
        raise UsageError("no prompt: give --prompt TEXT, --prompts-file PATH or --prompt-ids \"1,2,3\"")
    if not os.path.isdir(directory):
        raise UsageError(f"checkpoint directory {directory} does not exist")
    prompts = collect_prompts(args.sources)

    from ..config import ConfigError, load_config
    from ..distributed import is_primary
    from ..placement import PlacementError, load_placements, resolve_placement
    from ..safetensors_io import CheckpointError
    from ..engine.cache_layout import CacheConfigError
    from ..engine.sampling import SamplingError, SamplingParams
    from ..engine.tokenizer import ChatTemplateError, Tokenizer, TokenizerNotFound, with_end_of_turn

    errors = (ConfigError, CheckpointError, PlacementError, CacheConfigError, SamplingError, ChatTemplateError,
              FileNotFoundError, ValueError)
    try:
        # Sampling values first: a bad flag fails before anything is loaded.
        params = SamplingParams(
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            max_new_tokens=args.max_new_tokens,
            stop_token_ids=tuple(args.stop_token_ids),
            stop=tuple(args.stop),
            ignore_eos=args.ignore_eos,
            logprobs=args.logprobs,
        )
        # The run's seed is the engine seed, so that several prompts (even equal ones) draw different samples.
        engine_seed = 0 if params.seed is None else params.seed
        params = dataclasses.replace(params, seed=None)

        config = load_config(directory)
        max_model_len = args.max_model_len or config.max_position_embeddings

        named = load_placements(directory) if os.path.exists(os.path.join(directory, "placements.json")) else {}
        placement = parse_placement(args.placement, named)
        resolve_placement(config, placement, named)  # fail fast, before the weights are read

        needs_tokenizer = any(kind == "text" for kind, _ in prompts)
        try:
            tokenizer = Tokenizer.from_dir(directory)
        except TokenizerNotFound as err:
            if needs_tokenizer:
                raise UsageError(f"text prompts need a tokenizer, but {err}; give prompts as token ids "
                                 "(--prompt-ids \"1,2,3\", or {\"prompt\": [ids]} lines in --prompts-file)") from None
            if args.stop:
                raise UsageError(f"--stop strings need a tokenizer, but {err}; stop on token ids with "
                                 "--stop-token-ids") from None
            if args.chat_template:
                raise UsageError(f"--chat-template needs a tokenizer, but {err}") from None
            tokenizer = None
        use_chat_template = args.chat_template
        if use_chat_template is None:
            use_chat_template = tokenizer is not None and tokenizer.has_chat_template
        elif use_chat_template and not tokenizer.has_chat_template:
            raise UsageError(f"--chat-template: the tokenizer in {directory} has no chat template")

        if not params.ignore_eos:
            stop_ids = with_end_of_turn(params.stop_token_ids, tokenizer, config.vocab_size, config.eos_token_ids)
            params = dataclasses.replace(params, stop_token_ids=stop_ids)

        prompt_ids = encode_prompts(prompts, tokenizer, use_chat_template)
        for index, ids in enumerate(prompt_ids):
            if not ids:
                raise UsageError(f"prompt {index} is empty")
            bad = [t for t in ids if t >= config.vocab_size]
            if bad:
                raise UsageError(f"prompt {index}: token ids {bad[:5]} are outside the vocabulary [0, {config.vocab_size})")
            if len(ids) >= max_model_len:
                raise UsageError(
                    f"prompt {index} has {len(ids)} tokens; the model context (max_model_len) is {max_model_len}, "
                    f"which must leave room for at least one generated token (raise --max-model-len or shorten it)"
                )

        # Several processes run this same command, each on its own devices of one mesh; process 0 writes.
        primary = not join_processes(args) or is_primary()
        for index, ids in enumerate(prompt_ids):
            if primary and len(ids) + params.max_new_tokens > max_model_len:  # it stops with finish reason "length"
                print(f"apriel2-generate: warning: prompt {index} has {len(ids)} tokens, so the context "
                      f"(max_model_len {max_model_len}) leaves room for {max_model_len - len(ids)} of the "
                      f"{params.max_new_tokens} new tokens asked", file=sys.stderr)
        with contextlib.nullcontext(sys.stdout) if primary else open(os.devnull, "w") as stdout:
            outputs, wall, llm = _generate(args, directory, placement, named, engine_seed, tokenizer, prompt_ids,
                                           params, stdout, quiet=not primary)
    except UsageError:
        raise
    except SamplingError as err:  # named as its flag, which has the field's name
        raise UsageError(f"--{err.field.replace('_', '-')}: got {err.value!r}, expected {err.expected}") from None
    except CacheConfigError as err:  # engine settings: named as their flags
        raise UsageError(with_flag_names(str(err))) from None
    except errors as err:  # TokenizerNotFound is a FileNotFoundError
        raise UsageError(str(err)) from None
    except BrokenPipeError:  # stdout closed early (e.g. | head): not a usage error
        raise
    except OSError as err:  # the compilation cache's or the connector's directory, a checkpoint file
        where = "--compilation-cache: " if "compilation cache" in str(err) and args.compilation_cache else ""
        raise UsageError(f"{where}{err}") from None

    if not primary:
        return 0
    outputs.sort(key=lambda o: o.index)
    if args.json:
        sys.stdout.write(json.dumps([output_record(o) for o in outputs], ensure_ascii=False) + "\n")
        sys.stdout.flush()
    for line in summary_lines(llm, outputs, wall, args.warm_up == "all"):
        print(line, file=sys.stderr)
    return 0


def _generate(args, directory, placement, named, engine_seed, tokenizer, prompt_ids, params, stdout, quiet=False):
    """Build the engine and run every prompt, printing to ``stdout`` as requests progress; returns (outputs,
    seconds, llm). ``quiet``: no engine log (another process of a joined run logs for all of them)."""
    from ..engine.llm import LLM

    llm = LLM(directory, placement=placement, placements=named or None, seed=engine_seed, tokenizer=tokenizer,
              log=(lambda msg: None) if quiet else None, **engine_kwargs(args))

    outputs = []
    single = len(prompt_ids) == 1 and not args.json
    streamer = _Streamer(stdout, tokenizer, params.stop) if single else None
    start = time.monotonic()
    with contextlib.closing(llm.stream(prompt_ids, params)) as events:
        for event in events:
            if streamer is not None:
                streamer.update(event)
            if not event.finished:
                continue
            outputs.append(event.output)
            if streamer is not None:
                streamer.finish(event.output, args.logprobs)
            elif not args.json:
                _print_output(stdout, event.output, tokenizer is not None, args.logprobs)
    wall = time.monotonic() - start
    if llm.kv_connector is not None:  # saves run on a worker: they must be in the store before we exit
        llm.kv_connector.flush()
    return outputs, wall, llm


if __name__ == "__main__":
    sys.exit(main())

"""``apriel2-serve CHECKPOINT_DIR [options]``: an OpenAI-compatible HTTP server over the serving engine.

    apriel2-serve ckpt --port 8000 --placement main
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"model": "ckpt", "prompt": "Hello", "max_tokens": 16}'

Endpoints: /v1/models, /v1/completions, /v1/chat/completions (streaming with "stream": true), /health and
/metrics (Prometheus). The model and engine flags are apriel2-generate's. Usage errors exit with status 2.
"""

from __future__ import annotations

import argparse
import os
import sys

from .engine_args import add_engine_arguments, add_model_arguments, engine_kwargs, parse_placement

PROG = "apriel2-serve"


def build_parser() -> argparse.ArgumentParser:
    from ..server.app import DEFAULT_MAX_QUEUED_REQUESTS

    parser = argparse.ArgumentParser(prog=PROG, description="Serve an Apriel2 checkpoint over an OpenAI-compatible "
                                                            "HTTP API.")
    parser.add_argument("checkpoint_dir", metavar="CHECKPOINT_DIR",
                        help="checkpoint directory (config.json, weights, tokenizer.json for text, placements.json)")
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="default 8000")
    g.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model name clients send (default: the checkpoint directory's name)")
    g.add_argument("--max-queued-requests", type=int, default=DEFAULT_MAX_QUEUED_REQUESTS, metavar="N",
                   help="requests that may wait beyond the running batch (--max-num-seqs); more are answered 429 "
                        f"(default {DEFAULT_MAX_QUEUED_REQUESTS})")
    g.add_argument("--seed", type=int, default=0, help="engine seed: unseeded requests derive theirs from it")
    g.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's log level (default info)")
    add_model_arguments(parser)
    add_engine_arguments(parser)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 2
    directory = args.checkpoint_dir
    if not os.path.isdir(directory):
        print(f"{PROG}: error: checkpoint directory {directory} does not exist", file=sys.stderr)
        return 2
    if args.max_queued_requests < 0:
        print(f"{PROG}: error: --max-queued-requests must be >= 0", file=sys.stderr)
        return 2

    import jax
    import uvicorn

    from ..config import ConfigError
    from ..engine.cache_layout import CacheConfigError
    from ..engine.llm import LLM
    from ..engine.tokenizer import Tokenizer, TokenizerNotFound
    from ..placement import PlacementError, load_placements
    from ..safetensors_io import CheckpointError
    from ..server.app import create_app

    try:
        named = load_placements(directory) if os.path.exists(os.path.join(directory, "placements.json")) else {}
        placement = parse_placement(args.placement, named)
        try:
            tokenizer = Tokenizer.from_dir(directory)
        except TokenizerNotFound as err:
            print(f"{PROG}: {err}; serving token-id prompts only", file=sys.stderr)
            tokenizer = None
        if args.dtype == "float32":
            # On GPUs XLA would otherwise run float32 matmuls in TF32; this process only serves, so set it globally
            # (the engine thread compiles steps too).
            jax.config.update("jax_default_matmul_precision", "highest")
        llm = LLM(directory, placement=placement, placements=named or None, seed=args.seed, tokenizer=tokenizer,
                  **engine_kwargs(args))
    except (ConfigError, CheckpointError, PlacementError, CacheConfigError, FileNotFoundError, ValueError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2

    name = args.served_model_name or os.path.basename(os.path.normpath(directory))
    app = create_app(llm, model_name=name, max_queued_requests=args.max_queued_requests)
    print(f"{PROG}: serving {name!r} on http://{args.host}:{args.port} (OpenAI API under /v1)", file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())

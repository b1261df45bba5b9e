"""``apriel2-serve CHECKPOINT_DIR [options]``: an OpenAI-compatible HTTP server over the serving engine.

    apriel2-serve ckpt --port 8000 --placement main
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"model": "ckpt", "prompt": "Hello", "max_tokens": 16}'

Endpoints: /v1/models, /v1/completions, /v1/chat/completions (streaming with "stream": true), /health and
/metrics (Prometheus). The model and engine flags are apriel2-generate's. Usage errors exit with status 2, as do
a bad checkpoint and a host:port that cannot be bound (both found before the model loads).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

from .engine_args import (add_engine_arguments, add_model_arguments, engine_kwargs, non_negative_int, parse_placement,
                          with_flag_names)

PROG = "apriel2-serve"


def _port(value: str) -> int:
    # argparse's int would take 70000 (which the OS truncates to 4464) or -1 (which fails only after the model has
    # loaded): check the range here, so argparse names --port and exits 2 before anything loads.
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number 0-65535, got {value!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number 0-65535 (0: any free port), got {port}")
    return port


def bind_sockets(host: str, port: int) -> list[socket.socket]:
    """Sockets bound to every address of ``host`` at ``port``, as asyncio's create_server would bind them (uvicorn
    serves on them), and listening: binding before the model loads makes a busy port or an unknown host fail in a
    second rather than after loading and compiling the model, and a listening socket keeps the port (another
    SO_REUSEADDR socket could bind a socket that only bound it; clients that connect while the model loads wait).
    Address families this host cannot open (IPv6 off) are skipped, as asyncio does; none bound is an error.
    Raises OSError naming host and port."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        raise OSError(f"--host {host!r}: cannot resolve it ({err.strerror})") from None
    sockets: list[socket.socket] = []
    bound: set = set()
    try:
        for family, type_, proto, _, address in infos:
            address = (address[0], port, *address[2:])  # after --port 0 bound one: the same port for the others
            if (family, address) in bound:  # getaddrinfo may list an address once per protocol
                continue
            try:
                sock = socket.socket(family, type_, proto)
            except OSError:  # e.g. IPv6 unsupported by the kernel
                continue
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted server rebinds at once
            if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                # As asyncio does: the IPv4 address of the same host gets its own socket.
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, True)
            try:
                sock.bind(address)
                sock.listen(socket.SOMAXCONN)  # uvicorn's create_server listens again (harmless)
            except OSError as err:
                raise OSError(f"cannot listen on {_url(host, port)} (--host {host}, --port {port}): "
                              f"{err.strerror or err}") from None
            bound.add((family, address))
            if port == 0:  # the OS picked a free port: the host's other addresses take the same one
                port = sock.getsockname()[1]
        if not sockets:
            raise OSError(f"cannot listen on {_url(host, port)} (--host {host}): no address family of it can be "
                          "opened here")
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def build_parser() -> argparse.ArgumentParser:
    from ..server.app import DEFAULT_MAX_QUEUED_REQUESTS

    parser = argparse.ArgumentParser(prog=PROG, description="Serve an Apriel2 checkpoint over an OpenAI-compatible "
                                                            "HTTP API.")
    parser.add_argument("checkpoint_dir", metavar="CHECKPOINT_DIR",
                        help="checkpoint directory (config.json, weights, tokenizer.json for text, placements.json)")
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    g.add_argument("--port", type=_port, default=8000, help="port to listen on, 0-65535; 0 picks a free one "
                                                          "(default 8000)")
    g.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model name clients send (default: the checkpoint directory's name)")
    g.add_argument("--max-queued-requests", type=non_negative_int, default=DEFAULT_MAX_QUEUED_REQUESTS, metavar="N",
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

    import uvicorn

    from ..config import ConfigError, load_config
    from ..engine.cache_layout import CacheConfigError
    from ..engine.llm import LLM
    from ..engine.tokenizer import Tokenizer, TokenizerNotFound
    from ..placement import PlacementError, load_placements, resolve_placement
    from ..safetensors_io import CheckpointError
    from ..server.app import create_app

    sockets: list[socket.socket] = []
    try:
        # The checkpoint's own files first (config.json, placements), so that a directory that is not a checkpoint
        # is reported as such before anything about its tokenizer.
        config = load_config(directory)
        named = load_placements(directory) if os.path.exists(os.path.join(directory, "placements.json")) else {}
        placement = parse_placement(args.placement, named)
        resolve_placement(config, placement, named)  # fail fast, before the weights are read
        try:
            tokenizer = Tokenizer.from_dir(directory)
        except TokenizerNotFound:
            # What the server does without one (the error's own text names no alternative: that is the caller's).
            print(f"{PROG}: no tokenizer.json in {directory}: the server accepts prompts as token-id arrays only "
                  f"(/v1/completions); text prompts and chat completions are unavailable", file=sys.stderr)
            tokenizer = None
        kwargs = engine_kwargs(args)
        try:
            sockets = bind_sockets(args.host, args.port)
        except OSError as err:
            print(f"{PROG}: error: {err}", file=sys.stderr)
            return 2
        llm = LLM(directory, placement=placement, placements=named or None, seed=args.seed, tokenizer=tokenizer,
                  **kwargs)
        name = args.served_model_name or os.path.basename(os.path.normpath(directory))
        app = create_app(llm, model_name=name, max_queued_requests=args.max_queued_requests)
    except (ConfigError, CheckpointError, PlacementError, CacheConfigError, ValueError, OSError) as err:
        # OSError: a missing file, or the compilation cache's directory (named in the message)
        for sock in sockets:
            sock.close()
        message = with_flag_names(str(err)) if isinstance(err, CacheConfigError) else str(err)
        print(f"{PROG}: error: {message}", file=sys.stderr)
        return 2

    port = sockets[0].getsockname()[1]  # the one bound (--port 0 asks the OS for a free one)
    print(f"{PROG}: serving {name!r} on {_url(args.host, port)} (OpenAI API under /v1)", file=sys.stderr)
    # uvicorn serves on the sockets bound above (and closes them at shutdown) instead of binding host:port itself.
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=port, log_level=args.log_level))
    try:
        server.run(sockets=sockets)
    except KeyboardInterrupt:
        pass
    except SystemExit as exit_:  # uvicorn exits 3 when the app's start-up fails (it logged why)
        return exit_.code if isinstance(exit_.code, int) else 1
    finally:
        for sock in sockets:
            sock.close()
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())

"""Running the HTTP front: `HttpFront` (uvicorn on a socket we bind), `serve_http`, and `infer-api`.

`infer-api --coordinator tcp://H:P [--port 8000] [--host 127.0.0.1] [--api-key K] [--model M]` puts a front
on an existing cluster; several fronts may share one coordinator. `--model` is where the front reads the
tokenizer (chat template, prompt lengths, logprob token strings); by default the model the cluster
reports, and the embedded default model for the cluster's default id. On a cluster of several models each model's
tokenizer is read where its workers say, or where `--tokenizer-for NAME=PATH` says (client/api/tokenization.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import signal
import socket
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import uvicorn

from infer.client.api.admission import read_key_file, resolve_api_key
from infer.client.api.app import build_app
from infer.client.api.config import DEFAULT_MAX_BODY_BYTES, FrontConfig
from infer.client.api.model_defaults import generation_defaults, load_chat_template, matryoshka_dimensions
from infer.client.api.reasoning import REASONING_PARSERS
from infer.client.api.tokenization import load_tokenizers_for, parse_tokenizer_for
from infer.client.api.tools import TOOL_PARSERS
from infer.client.engine_client import EngineClient
from infer.client.inference_client import ClusterError, InferenceClient, parse_addresses
from infer.protocol.keys import CurveKeys, refuse_open_bind
from infer.protocol.logs import add_logging_args, setup_logging
from infer.protocol.options import add_options, add_vllm_flags, option, to_argv
from infer.worker.engine.config import DEFAULT_MODEL_ID

log = logging.getLogger("infer.api")


class _Server(uvicorn.Server):
    """uvicorn without its own signal handlers: the program that embeds the front owns SIGINT / SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpFront:
    """The HTTP front on a bound socket. `port=0` picks a free port (read `.port` after `bind()`)."""

    def __init__(
        self,
        engine: EngineClient,
        tokenizer: Any,
        config: FrontConfig,
        host: str = "127.0.0.1",
        port: int = 8000,
        graceful_timeout: float = 5.0,
        tokenizers_for: Mapping[str, Any] | None = None,
        tokenizer_dir: Path | None = None,
    ) -> None:
        """`graceful_timeout`: on shutdown, seconds open requests get to finish (new connections refused);
        `tokenizers_for`, `tokenizer_dir`: app.Front's."""
        if not 0 <= port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {port}")
        if not graceful_timeout >= 0:
            raise ValueError(f"graceful_timeout must be >= 0 seconds, got {graceful_timeout}")
        self.graceful_timeout = graceful_timeout
        self.app = build_app(engine, tokenizer, config, tokenizers_for, tokenizer_dir)
        self.host = host
        self.port = port
        self._socket: socket.socket | None = None
        self._server = _Server(
            uvicorn.Config(
                self.app,
                log_level="warning",
                access_log=False,
                lifespan="off",
                # uvicorn types it int; it is wait_for's timeout, a float
                timeout_graceful_shutdown=graceful_timeout,  # type: ignore[arg-type]
            )
        )

    def bind(self) -> int:
        """Bind and listen now (so the caller can print the address before serving); returns the port."""
        self._listen()
        return self.port

    def _listen(self) -> socket.socket:
        sock = self._socket = listen_socket(self.host, self.port)
        self.port = sock.getsockname()[1]
        return sock

    def adopt(self, sock: socket.socket) -> int:
        """Serve on `sock`, a listening socket made elsewhere (infer-serve's, inherited); returns its port."""
        self._socket = sock
        self.host, self.port = sock.getsockname()[:2]
        return self.port

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def serve(self) -> None:
        """Serve until cancelled (or `shutdown()`); open connections get a bounded graceful close."""
        sock = self._socket if self._socket is not None else self._listen()
        try:
            await self._server.serve(sockets=[sock])
        except asyncio.CancelledError:
            self._server.should_exit = True
            raise
        finally:
            sock.close()
            self.app.state.front.close()

    def shutdown(self) -> None:
        self._server.should_exit = True


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on host:port (0: a free port), inheritable: infer-serve keeps it and hands it to
    each HTTP front process it starts, so connections wait in its backlog while a front restarts."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


async def serve_http(
    engine: EngineClient,
    *,
    tokenizer: Any,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_concurrent_requests: int = 1024,
    on_ready: Callable[[str], None] | None = None,
) -> None:
    """Serve `engine` over HTTP until cancelled. `port=0` picks a free port; `on_ready(url)` is called once
    the socket listens (connections made from then on are served)."""
    name = served_model_name or engine.model_id or DEFAULT_MODEL_ID
    front = HttpFront(
        engine,
        tokenizer,
        FrontConfig(served_model_name=name, api_key=api_key, max_concurrent_requests=max_concurrent_requests),
        host=host,
        port=port,
    )
    front.bind()
    log.info("HTTP front on %s serving %r", front.url, name)
    if on_ready is not None:
        on_ready(front.url)
    await front.serve()


def front_model_dir(model: str | None, model_id: str | None) -> Path:
    """The directory of `model` (a path), else of the model the cluster reports (`model_id`): where the front reads
    the tokenizer and generation_config.json (a GGUF not converted on this machine yet is converted here, which
    imports torch)."""
    from infer.worker.loading.model_files import resolve_model

    source = model if model is not None else (None if model_id in (None, DEFAULT_MODEL_ID) else model_id)
    try:
        return resolve_model(source)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"cannot read the model {source or 'the embedded default model'!r}: {e}; "
            f"pass --model with the model's directory or .gguf file"
        ) from None


def load_front_tokenizer(model: str | None, model_id: str | None) -> Any:
    """The tokenizer of `front_model_dir(model, model_id)`, read without importing torch
    (worker/loading/model_files.py)."""
    from infer.worker.loading.model_files import front_tokenizer

    path = front_model_dir(model, model_id)
    try:
        return front_tokenizer(path)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"cannot load the tokenizer from {str(path)!r}: {e}; pass --model with the model's directory or .gguf file"
        ) from None


# ---- infer-api ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FrontFlags:
    """The flags every command that runs a front shares (infer-api, infer-serve, the Slurm launcher), declared once
    (protocol/options.py): `add_front_arguments` adds them, `front_argv` passes them on to an infer-api child,
    `front_config` resolves them into the FrontConfig (the keys read, the template and the generation config
    loaded)."""

    host: str = option("127.0.0.1", "the HTTP front's bind address")
    port: int = option(8000, "the HTTP front's port (0: a free one)")
    api_key: str | None = option(
        None,
        "require 'Authorization: Bearer <key>' (visible in the process list: prefer "
        "--api-key-file or $INFER_API_KEY; none of the three: no key)",
    )
    api_key_file: str | None = option(None, "read the API key from the first line of FILE", metavar="FILE")
    admin_api_key_file: str | None = option(
        None,
        "the admin's key, from the first line of FILE: its bearer may "
        "cancel any request (POST /v1/requests/{id}/cancel; a caller may cancel "
        "its own)",
        metavar="FILE",
    )
    served_model_name: str | None = option(None, "the model name clients send (default: the cluster's model id)")
    max_concurrent_requests: int = option(
        1024, "engine requests in flight through this front; past it new requests get 503 'overloaded' at once"
    )
    max_body_bytes: int = option(DEFAULT_MAX_BODY_BYTES, "largest request body; larger ones get 413")
    allowed_local_media_path: str | None = option(
        None,
        "serve chat image_url parts given as file:// URLs from files under DIR (vLLM's flag; default: refused); "
        "http(s) URLs are never fetched, base64 data: URLs always taken",
        metavar="DIR",
    )
    tool_call_parser: str | None = option(
        None,
        "the format of the model's tool calls (default: the one its chat "
        "template uses: mistral, llama3_json, else hermes)",
        choices=TOOL_PARSERS,
    )
    reasoning_parser: str | None = option(
        None, "split <think>...</think> into reasoning_content (default: off)", choices=REASONING_PARSERS
    )
    chat_template: str | None = option(
        None,
        "the chat template to use instead of the tokenizer's: a file, or the Jinja template itself (vLLM's flag)",
        metavar="FILE_OR_TEMPLATE",
    )
    generation_config: str = option(
        "auto",
        "sampling defaults for requests that leave them out (vLLM's flag): auto "
        "reads the model's generation_config.json (temperature, top_p, top_k, min_p, "
        "repetition_penalty, max_new_tokens as max_tokens), PATH that folder's (or "
        "file), vllm none; a request's own values win",
        metavar="auto|vllm|PATH",
    )
    otlp_traces_endpoint: str | None = option(
        None,
        "export an OpenTelemetry span of each request's hop through the "
        "front to this OTLP endpoint, the child of the caller's W3C "
        "'traceparent' header (vLLM's flag; needs pip install "
        "'infer[otel]')",
        metavar="URL",
    )
    tokenizer_for: tuple[tuple[str, str], ...] = option(
        (),
        "on a cluster of several models: read model NAME's tokenizer from PATH (a directory with its tokenizer "
        "files, or a .gguf file), not from where its workers say they read it (a front on another host); "
        "repeatable; loaded at start",
        metavar="NAME=PATH",
        parse=parse_tokenizer_for,
        show=lambda pair: f"{pair[0]}={pair[1]}",
    )
    trusted_network: bool = option(
        False,
        "allow a non-loopback bind with nothing protecting it: the HTTP front "
        "without an API key (and a coordinator this command starts without CURVE keys); "
        "otherwise it is refused",
    )


_NOT_PASSED_ON = ("host", "port", "api_key", "api_key_file")  # the child inherits the socket; the key: see below


def add_front_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of FrontFlags, defaulting to its defaults."""
    add_options(p, FrontFlags, defaults=True)


def front_argv(args: argparse.Namespace) -> list[str]:
    """The flags of `add_front_arguments` that `args` gives, for an infer-api child (infer-serve's front), less
    the bind address (the child inherits the socket) and the API key (resolved here, passed in its
    environment: never on a command line)."""
    return to_argv(FrontFlags, vars(args), exclude=_NOT_PASSED_ON)


def check_front_exposure(host: str, config: FrontConfig, trusted_network: bool) -> None:
    """ValueError when the front would serve a non-loopback `host` with no API key and the network is not
    declared trusted."""
    if config.api_key is None and not trusted_network:
        refuse_open_bind(
            host, what="the HTTP front", remedy="give it a key (--api-key-file FILE, $INFER_API_KEY or --api-key K)"
        )


def media_dir(path: str | None) -> Path | None:
    """--allowed-local-media-path, resolved; ValueError naming the flag unless it is a directory."""
    if path is None:
        return None
    resolved = Path(path).resolve()
    if not resolved.is_dir():
        raise ValueError(f"--allowed-local-media-path {path}: not a directory")
    return resolved


def front_config(args: argparse.Namespace, model_id: str | None, model_dir: Path | None = None) -> FrontConfig:
    """The FrontConfig the flags describe; ValueError (naming the flag) if they are invalid. `model_dir`: where
    --generation-config auto looks (None: nowhere yet)."""
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    return FrontConfig(
        served_model_name=args.served_model_name or model_id or DEFAULT_MODEL_ID,
        api_key=resolve_api_key(args.api_key, args.api_key_file),
        admin_api_key=(
            None if args.admin_api_key_file is None else read_key_file(args.admin_api_key_file, "--admin-api-key-file")
        ),
        max_concurrent_requests=args.max_concurrent_requests,
        max_body_bytes=args.max_body_bytes,
        allowed_local_media_path=media_dir(args.allowed_local_media_path),
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        chat_template=None if args.chat_template is None else load_chat_template(args.chat_template),
        sampling_defaults=generation_defaults(args.generation_config, model_dir),
        matryoshka_dimensions=matryoshka_dimensions(model_dir),
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        tokenizer_for=tuple(args.tokenizer_for or ()),
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="infer-api",
        description="An OpenAI-compatible HTTP front on an existing infer cluster (several may share one coordinator).",
    )
    p.add_argument(
        "--coordinator",
        required=True,
        help="the coordinator's address, tcp://HOST:PORT, or every coordinator's of a cluster with several, "
        "comma-separated (the front talks to the one that leads)",
    )
    p.add_argument("--model", help="where to read the tokenizer (default: the model the cluster serves)")
    add_front_arguments(p)
    p.add_argument("--connect-timeout", type=float, default=30.0, help="seconds to reach the coordinator")
    p.add_argument(
        "--graceful-timeout",
        type=float,
        default=5.0,
        help="on SIGTERM, seconds open requests get to finish (default 5)",
    )
    p.add_argument(
        "--listen-fd",
        type=int,
        metavar="FD",
        help="serve on this inherited listening socket "
        "instead of binding --host / --port (infer-serve's: it keeps the socket across restarts of "
        "its front)",
    )
    p.add_argument(
        "--curve-key",
        metavar="FILE",
        help="CurveZMQ: this front's secret key file, as a client "
        "of a coordinator with keys (with --coordinator-key; infer-keygen makes both): a client key "
        "(the coordinator's clients/ folder), never an admin key, since HTTP callers act with it",
    )
    p.add_argument("--coordinator-key", metavar="FILE", help="CurveZMQ: the coordinator's public key file")
    add_logging_args(p)
    add_vllm_flags(p)
    return p


async def run_front(client: InferenceClient, front: HttpFront) -> None:
    """Serve until SIGINT / SIGTERM."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    serving = asyncio.create_task(front.serve())
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait([serving, stopped], return_when=asyncio.FIRST_COMPLETED)
    front.shutdown()
    stopped.cancel()
    await asyncio.wait([serving], timeout=front.graceful_timeout + 5)
    failure = serving.exception() if serving.done() and not serving.cancelled() else None
    if failure is not None:
        raise failure


async def _main(args: argparse.Namespace, tokenizers_for: Mapping[str, Any]) -> int:
    try:
        async with InferenceClient(
            args.coordinator,
            connect_timeout=args.connect_timeout,
            curve_key=args.curve_key,
            coordinator_key=args.coordinator_key,
        ) as client:
            tokenizer = load_front_tokenizer(args.model, client.model_id)
            model_dir = front_model_dir(args.model, client.model_id)
            front = HttpFront(
                client,
                tokenizer,
                front_config(args, client.model_id, model_dir),
                args.host,
                args.port,
                graceful_timeout=args.graceful_timeout,
                tokenizers_for=tokenizers_for,
                tokenizer_dir=model_dir,
            )
            if args.listen_fd is None:
                front.bind()
            else:
                front.adopt(socket.socket(fileno=args.listen_fd))
            print(
                f"infer-api: serving {front.app.state.front.config.served_model_name!r} on {front.url}, "
                f"cluster {args.coordinator}",
                flush=True,
            )
            await run_front(client, front)
    except (ClusterError, ValueError, OSError) as e:
        print(f"infer-api: {e}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    try:
        config = front_config(args, None)
        parse_addresses(args.coordinator)
        check_front_exposure(args.host, config, args.trusted_network)
        CurveKeys.from_files(args.curve_key, args.coordinator_key, flags=("--curve-key", "--coordinator-key"))
        tokenizers_for = load_tokenizers_for(config.tokenizer_for)
    except ValueError as e:
        print(f"infer-api: {e}", file=sys.stderr)
        return 2
    return asyncio.run(_main(args, tokenizers_for))


if __name__ == "__main__":
    sys.exit(main())

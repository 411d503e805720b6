"""Serve a model over the OpenAI API with speculative decoding and continuous batching.

    verispec serve --model default --prompt-lookup --port 8000
    python -m verispec.entrypoints.openai.api_server --model default --speculative-model DRAFT

Endpoints: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health,
GET /metrics (Prometheus). Streaming answers are server-sent events ending with ``data: [DONE]``.
Every response carries its acceptance statistics in the extra field ``"speculative"``; a request
can switch speculation off or choose its draft length with ``"speculative": {"enabled": false}`` or
``{"num_speculative_tokens": 2}``. Errors are OpenAI-style JSON (``{"error": {...}}``).
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import sys
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from verispec.commands.common import add_model_arguments, check_model_arguments
from verispec.config import ConfigError
from verispec.entrypoints.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    RequestPlan,
    created,
    new_id,
    parse,
    plan,
    speculative_stats,
    usage,
)
from verispec.entrypoints.openai.scheduler import BatchPolicy, Scheduler, ServerRequest, Update

log = logging.getLogger("verispec.serve")

DEFAULT_MAX_MODEL_LEN = 2048
DISCONNECT_POLL_S = 0.5


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``verispec serve`` (and of ``python -m verispec.entrypoints.openai.api_server``)."""
    add_model_arguments(p, draft_flag="--speculative-model")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="the model name clients use (default: --model)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 endpoints")
    p.add_argument("--max-num-seqs", type=int, default=16, help="sequences in the running batch at most")
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help=f"context length: prompt + completion (default: the model's, at most {DEFAULT_MAX_MODEL_LEN})",
    )
    p.add_argument("--max-request-bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    p.add_argument(
        "--batch-policy",
        default=None,
        help="draft-length caps by batch size as 'max_batch:k,...' (default: measured, see "
        "benchmarks/SERVER.md); 'off' never caps",
    )
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])


@dataclass
class ServerState:
    """Everything the request handlers need."""

    scheduler: Scheduler
    tokenizer: Any
    served_model_name: str
    max_model_len: int
    default_k: int
    api_key: str | None
    max_request_bytes: int
    chat: bool
    """The model has a chat template."""


def build_state(args: argparse.Namespace) -> ServerState:
    """Load target and drafter; the caller runs ``scheduler.run_here()`` in the thread that loaded
    them (see ``_load_in_engine_thread``)."""
    from verispec.adaptive import adapt_k
    from verispec.commands.drafters import proposer_from_args
    from verispec.engine import Engine
    from verispec.entrypoints.openai.metrics import ServerMetrics
    from verispec.models.loading import load_model

    max_len = args.max_model_len
    target = load_model(
        args.model,
        backend=args.backend,
        dtype=args.dtype,
        device=args.device,
        max_batch_size=args.max_num_seqs,
        max_length=max_len or DEFAULT_MAX_MODEL_LEN,
    )
    target.reset(args.max_num_seqs)
    proposer = None
    if args.num_speculative_tokens > 0:
        proposer = proposer_from_args(target, args, max_batch_size=args.max_num_seqs)
    tok = target.tokenizer
    engine = Engine(
        target,
        proposer,
        eos_token_ids=target.eos_token_ids,
        decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
        adaptive=adapt_k,
    )
    name = args.served_model_name or args.model
    policy = BatchPolicy.parse(args.batch_policy) if args.batch_policy else BatchPolicy()
    scheduler = Scheduler(engine, args.max_num_seqs, ServerMetrics(name), policy)
    return ServerState(
        scheduler=scheduler,
        tokenizer=tok,
        served_model_name=name,
        max_model_len=int(target.max_length),
        default_k=args.num_speculative_tokens,
        api_key=args.api_key,
        max_request_bytes=args.max_request_bytes,
        chat=bool(getattr(tok, "chat_template", None)),
    )


def build_app(state: ServerState):
    """The FastAPI application over a started :class:`ServerState`."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    app = FastAPI(title="verispec", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(APIError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return JSONResponse(APIError(500, f"internal error: {type(exc).__name__}").body(), status_code=500)

    @app.get("/health")
    async def health() -> Response:
        if not state.scheduler.healthy:
            return JSONResponse(APIError(503, "the engine thread is not running").body(), status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(state.scheduler.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        _check_auth(state, request)
        card = {
            "id": state.served_model_name,
            "object": "model",
            "created": created(),
            "owned_by": "verispec",
            "max_model_len": state.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        _check_auth(state, request)
        req = parse(ChatCompletionRequest, await _read_json(state, request))
        _check_model(state, req.model)
        if not state.chat:
            raise APIError(400, "this model has no chat template: use /v1/completions", param="messages")
        if not req.messages:
            raise APIError(400, "messages must not be empty", param="messages")
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            ids = state.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as exc:  # a template may reject e.g. the order of roles
            raise APIError(400, f"the chat template rejected the messages: {exc}", param="messages") from None
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return await _generate(state, request, req, [int(t) for t in ids], chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        _check_auth(state, request)
        req = parse(CompletionRequest, await _read_json(state, request))
        _check_model(state, req.model)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(
                    400, "one prompt per request: send a list of prompts as separate requests", param="prompt"
                )
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise APIError(400, "the prompt is empty", param="prompt")
            ids = [int(t) for t in state.tokenizer(prompt).input_ids]
        else:
            ids = list(prompt)
        return await _generate(state, request, req, ids, chat=False)

    async def _generate(
        state: ServerState, request: Request, req: Any, ids: list[int], chat: bool
    ) -> Response:
        if not ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        p = plan(req, len(ids), state.max_model_len, state.default_k)
        engine = state.scheduler.engine
        try:
            seq = engine.new_sequence(ids, p.config)
        except ConfigError as exc:
            raise APIError(400, str(exc), param="prompt") from None
        loop = asyncio.get_running_loop()
        sreq = ServerRequest(seq=seq, loop=loop, queue=asyncio.Queue(), k=seq.k, stream=p.stream)
        state.scheduler.submit(sreq)
        rid = new_id("chatcmpl" if chat else "cmpl")
        if p.stream:
            body = _stream(state, request, sreq, p, rid, chat)
            return _CancellingStream(
                body, on_close=lambda: state.scheduler.cancel(sreq), media_type="text/event-stream"
            )
        try:
            final = await _final_update(request, sreq)
        finally:
            state.scheduler.cancel(sreq)  # no-op once finished; frees the slot if the client left
        if final is None:
            return Response(status_code=499)
        if final.error is not None:
            raise APIError(500, f"generation failed: {final.error}")
        choice: dict[str, Any] = {"index": 0, "finish_reason": final.finish_reason, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": final.text}
        else:
            choice["text"] = final.text
        body = {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": created(),
            "model": state.served_model_name,
            "choices": [choice],
            "usage": usage(seq.prompt_len, final.completion_tokens),
            "speculative": speculative_stats(final.stats or {}, sreq.k),
        }
        return JSONResponse(body)

    class _CancellingStream(StreamingResponse):
        """A streaming response that cancels its request however the stream ends."""

        def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None], **kw: Any):
            super().__init__(content, **kw)
            self._on_close = on_close

        async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001 - ASGI signature
            try:
                await super().__call__(scope, receive, send)
            finally:
                self._on_close()

    return app


class _Stop(Exception):
    """The client went away."""


async def _next_update(request: Any, sreq: ServerRequest) -> Update:
    """The request's next update, polling for a client disconnect while waiting."""
    while True:
        try:
            return await asyncio.wait_for(sreq.queue.get(), timeout=DISCONNECT_POLL_S)
        except TimeoutError:
            if await request.is_disconnected():
                raise _Stop() from None


async def _final_update(request: Any, sreq: ServerRequest) -> Update | None:
    """Wait for the request's last update; None if the client disconnected first."""
    try:
        while True:
            update = await _next_update(request, sreq)
            if update.finish_reason is not None:
                return update
    except _Stop:
        return None


async def _stream(
    state: ServerState, request: Any, sreq: ServerRequest, p: RequestPlan, rid: str, chat: bool
) -> AsyncIterator[str]:
    """Server-sent events: a role chunk (chat), text deltas, a final chunk with the finish reason and
    statistics, an optional usage chunk, then ``data: [DONE]``."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    stamp = created()

    def chunk(
        delta: str | None, finish: str | None = None, extra: dict | None = None, role: bool = False
    ) -> str:
        if chat:
            d: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if delta:
                d["content"] = delta
            choice: dict[str, Any] = {"index": 0, "delta": d, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": None}
        body = {
            "id": rid,
            "object": kind,
            "created": stamp,
            "model": state.served_model_name,
            "choices": [choice],
        }
        if extra:
            body.update(extra)
        return f"data: {json.dumps(body)}\n\n"

    if chat:
        yield chunk(None, role=True)
    sent = ""
    stop = sreq.seq.config.stop
    try:
        while True:
            update = await _next_update(request, sreq)
            if update.error is not None:
                err = APIError(500, f"generation failed: {update.error}").body()
                yield f"data: {json.dumps(err)}\n\n"
                break
            done = update.finish_reason is not None
            text = update.text if done else _settled(update.text, stop)
            delta = text[len(sent) :] if len(text) > len(sent) else ""
            if delta:
                sent = text
            if done:
                extra = {"speculative": speculative_stats(update.stats or {}, sreq.k)}
                yield chunk(delta, update.finish_reason, extra)
                if p.include_usage:
                    body = {
                        "id": rid,
                        "object": kind,
                        "created": stamp,
                        "model": state.served_model_name,
                        "choices": [],
                        "usage": usage(sreq.seq.prompt_len, update.completion_tokens),
                    }
                    yield f"data: {json.dumps(body)}\n\n"
                break
            if delta:
                yield chunk(delta)
        yield "data: [DONE]\n\n"
    except _Stop:
        return
    finally:
        state.scheduler.cancel(sreq)


def _settled(text: str, stop: tuple[str, ...]) -> str:
    """The part of a running request's text that can be sent: without a trailing partial UTF-8
    character or a trailing prefix of a stop string (which may yet be cut)."""
    text = text.rstrip("\ufffd")
    hold = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:n]):
                hold = n
                break
    return text[: len(text) - hold]


def _check_auth(state: ServerState, request: Any) -> None:
    if state.api_key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), state.api_key.encode()):
        raise APIError(
            401, "missing or invalid API key: send 'Authorization: Bearer <key>'", code="invalid_api_key"
        )


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.served_model_name:
        raise APIError(
            404,
            f"The model '{model}' does not exist; this server serves '{state.served_model_name}'.",
            param="model",
            code="model_not_found",
        )


async def _read_json(state: ServerState, request: Any) -> Any:
    """The request body as JSON, refusing bodies over the size limit (413) and malformed JSON (400)."""
    limit = state.max_request_bytes
    declared = request.headers.get("content-length")
    too_big = APIError(413, f"the request body exceeds the limit of {limit} bytes", code="request_too_large")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise too_big
        chunks.append(part)
    try:
        return json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None


def run(args: argparse.Namespace) -> int:
    """Validate, load the models, serve until interrupted."""
    import uvicorn

    if args.max_num_seqs < 1:
        raise ConfigError(f"--max-num-seqs must be >= 1, got {args.max_num_seqs}")
    if args.max_model_len is not None and args.max_model_len < 2:
        raise ConfigError(f"--max-model-len must be >= 2, got {args.max_model_len}")
    if args.batch_policy:
        try:
            BatchPolicy.parse(args.batch_policy)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    check_model_arguments(args)
    logging.getLogger("verispec").setLevel(args.log_level.upper())
    state = _load_in_engine_thread(args)
    app = build_app(state)
    log.warning("serving %s on http://%s:%d/v1", state.served_model_name, args.host, args.port)
    try:
        uvicorn.run(
            app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5
        )
    finally:
        state.scheduler.stop()
    return 0


def _load_in_engine_thread(args: argparse.Namespace) -> ServerState:
    """Load the models in a new thread that then runs the engine loop, so loading and decoding share
    one team of kernel threads (see ``Scheduler.run_here``); load errors are raised here."""
    box: dict[str, Any] = {}
    ready = threading.Event()

    def engine_main() -> None:
        try:
            box["state"] = build_state(args)
            box["state"].scheduler.bind_to_current_thread()
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread, which raises it
            box["error"] = exc
            return
        finally:
            ready.set()
        box["state"].scheduler.run_here()

    threading.Thread(target=engine_main, name="verispec-engine", daemon=True).start()
    ready.wait()
    if "error" in box:
        raise box["error"]
    return box["state"]


def main(argv: list[str] | None = None) -> int:
    """``python -m verispec.entrypoints.openai.api_server``: the same flags as ``verispec serve``."""
    logging.basicConfig(level=logging.WARNING, format="verispec: %(message)s")
    parser = argparse.ArgumentParser(
        prog="python -m verispec.entrypoints.openai.api_server",
        description=(__doc__ or "").strip().splitlines()[0],
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    from verispec.cli import call

    return call("serve", run, args)


if __name__ == "__main__":
    sys.exit(main())

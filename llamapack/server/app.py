"""OpenAI-compatible Flask app around one loaded model (a ``llamapack.Llama`` or any ``llama_cpp.Llama``).

One generation runs at a time (``state.lock``); up to ``queue_size`` generation requests are admitted at
once (the one generating plus those waiting for it), one more is answered 429 with ``Retry-After``. A
streamed request holds its admission until its response is closed: finished, failed, or its client gone
(the WSGI server closes the response iterable, which runs the stream's ``finally``).

A request is checked before it is admitted: its body size (``max_body_bytes``, else 413), its fields
(params.py: forwarded to llama_cpp, or 400 naming the field) and its prompt, tokenized (empty, not UTF-8 or
longer than the context: 400), so a bad request never waits for the generation. Any model name is accepted:
the one model answers (as llama-server does), so clients configured for another name work.
``/v1/embeddings`` answers when the model was loaded with ``embedding=True`` (``serve --embedding``).

Errors use OpenAI's shape ``{"error": {"message", "type", "code"}}``, status chosen by exception type.
``/stats`` gives the pack counters and the last request's rates; ``/`` is a chat page (static/index.html).
"""
from __future__ import annotations

import base64
import hmac
import json
import logging
import os
import threading
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

from flask import Flask, Response, jsonify, request
from werkzeug.exceptions import HTTPException

from ..errors import CapacityError, InputError, LlamapackError, NativeError, PackIOError
from ..run import RunStats, Runner, check_prompt, utf8
from .params import request_kwargs


class ApiError(LlamapackError):
    """A request the server refuses; the subclass decides the HTTP status."""


class BadRequestError(ApiError):
    """Malformed JSON, missing or out-of-range fields, a prompt the context cannot hold."""


class AuthenticationError(ApiError):
    """Missing or wrong API key."""


class QueueFullError(ApiError):
    """Every admission slot is taken."""


# exception type -> (HTTP status, OpenAI error type, code); the closest class in the MRO wins
ERRORS = {
    BadRequestError: (400, "invalid_request_error", None),
    AuthenticationError: (401, "invalid_request_error", "invalid_api_key"),
    InputError: (400, "invalid_request_error", None),
    QueueFullError: (429, "rate_limit_error", "queue_full"),
    CapacityError: (503, "server_error", "capacity"),
    PackIOError: (500, "server_error", "pack_io_error"),
    NativeError: (500, "server_error", "native_error"),
    LlamapackError: (500, "server_error", None),
}
RETRY_AFTER_S = 1
MAX_BODY_BYTES = 8 << 20  # a larger request body is answered 413 before it is read


def error_body(exc: BaseException) -> tuple[dict, int]:
    """OpenAI's error JSON for ``exc`` and its HTTP status."""
    if isinstance(exc, HTTPException):  # routing: unknown path, wrong method
        return {"error": {"message": exc.description, "type": "invalid_request_error", "code": None}}, exc.code
    for cls in type(exc).__mro__:
        if cls in ERRORS:
            status, kind, code = ERRORS[cls]
            return {"error": {"message": " ".join(str(exc).split()), "type": kind, "code": code}}, status
    return {"error": {"message": "internal server error", "type": "server_error", "code": None}}, 500


@dataclass
class ServerState:
    llm: object
    model_name: str
    api_key: str | None
    queue_size: int
    lock: threading.Lock = field(default_factory=threading.Lock)
    admitted: threading.BoundedSemaphore = field(init=False)
    last: RunStats = field(default_factory=RunStats)   # the last finished generation
    total: RunStats = field(default_factory=RunStats)  # every generation since start

    def __post_init__(self):
        self.admitted = threading.BoundedSemaphore(self.queue_size)


def create_app(llm, *, api_key: str | None = None, queue_size: int = 4, model_name: str | None = None,
               max_body_bytes: int = MAX_BODY_BYTES) -> Flask:
    """A Flask app serving ``llm``: OpenAI routes under ``/v1``, ``/stats``, a chat page at ``/``. With
    ``api_key`` every route but the page and its static files wants ``Authorization: Bearer <api_key>``.
    Requests may name any model (clients configured for another name still work): the one model answers."""
    if queue_size < 1:
        raise LlamapackError(f"queue_size must be at least 1, not {queue_size}")
    if api_key is not None and not api_key.strip():
        raise LlamapackError("the API key is empty: give a non-empty key, or none to serve without one")
    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = max_body_bytes
    state = ServerState(llm, model_name or os.path.basename(llm.model_path), api_key, queue_size)
    app.extensions["llamapack"] = state

    @app.errorhandler(Exception)
    def on_error(exc):
        body, status = error_body(exc)
        if status >= 500:
            app.logger.error("%s %s failed", request.method, request.path, exc_info=exc)
        response = jsonify(body)
        response.status_code = status
        if isinstance(exc, QueueFullError):
            response.headers["Retry-After"] = str(RETRY_AFTER_S)
        return response

    @app.before_request
    def check_key():
        if state.api_key is None or request.endpoint in ("index", "static"):
            return
        scheme, _, key = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), state.api_key.encode()):
            raise AuthenticationError("invalid or missing API key (send Authorization: Bearer KEY)")

    @app.get("/")
    def index():
        return app.send_static_file("index.html")

    def model_card():
        return {"id": state.model_name, "object": "model", "created": 0, "owned_by": "llamapack"}

    @app.get("/v1/models")
    def models():
        return jsonify({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/<path:name>")
    def model(name):  # any name: the one model served
        return jsonify(model_card())

    @app.post("/v1/completions")
    def completions():
        body = request_json()
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise BadRequestError("'prompt' must be a string")
        check_prompt(state.llm, prompt)  # before the request is queued: a bad one never waits for the lock
        return generate(state, lambda llm, **kw: llm.create_completion(prompt, **kw), body, chat=False)

    @app.post("/v1/chat/completions")
    def chat_completions():
        body = request_json()
        messages = body.get("messages")
        if not (isinstance(messages, list) and messages and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content") or "", str)
                for m in messages)):
            raise BadRequestError("'messages' must be a non-empty list of {role, content} objects")
        check_messages(state.llm, messages)
        return generate(state, lambda llm, **kw: llm.create_chat_completion(messages, **kw), body, chat=True)

    @app.post("/v1/embeddings")
    def embeddings():
        return jsonify(embed(state, request_json()))

    @app.get("/stats")
    def stats():
        pack = llm.pack_stats() if hasattr(llm, "pack_stats") else {}

        def numbers(run: RunStats) -> dict:  # pack counters are reported once, above
            return {k: v for k, v in run.as_dict().items() if k != "pack"}

        return jsonify({"model": state.model_name, "pack": pack, "last_request": numbers(state.last),
                        "total": numbers(state.total), "busy": state.lock.locked()})

    return app


def request_json() -> dict:
    request.get_data()  # a body over the limit is answered 413 here (get_json(silent=True) would hide it)
    body = request.get_json(force=True, silent=True)
    if not isinstance(body, dict):
        raise BadRequestError("the request body must be a JSON object")
    return body


def check_messages(llm, messages: list[dict]) -> None:
    """InputError for a message that is not UTF-8, or contents that alone fill the context (the chat template
    adds more; what still does not fit is refused when the prompt is built)."""
    n = 0
    for i, message in enumerate(messages):
        content = utf8(message.get("content") or "", f"message {i + 1} ({message['role']})")
        n += len(llm.tokenize(content, add_bos=False, special=True)) if content else 0
    if n >= llm.n_ctx():
        raise InputError(f"the messages are {n} tokens; the context holds {llm.n_ctx()} for them and the reply")


@contextmanager
def admission(state: ServerState):
    """Admitted (else QueueFullError, 429) and holding the generation lock, until the block ends."""
    if not state.admitted.acquire(blocking=False):
        raise QueueFullError(f"the server is busy ({state.queue_size} requests admitted); retry later")
    try:
        with state.lock:
            yield
    finally:
        state.admitted.release()


def embed(state: ServerState, body: dict) -> dict:
    """OpenAI's embeddings response for ``body`` (``input``: a string or a list of them)."""
    if not state.llm.context_params.embeddings:
        raise BadRequestError("this server computes no embeddings: start it with --embedding (embedding=True)")
    unknown = set(body) - {"input", "model", "encoding_format", "user"}
    if unknown:
        raise BadRequestError(f"'{sorted(unknown)[0]}' is not supported by /v1/embeddings")
    inputs = [body.get("input")] if isinstance(body.get("input"), str) else body.get("input")
    if not (isinstance(inputs, list) and inputs and all(isinstance(text, str) for text in inputs)):
        raise BadRequestError("'input' must be a string or a non-empty list of strings")
    encoding = body.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise BadRequestError("'encoding_format' must be \"float\" or \"base64\"")
    for i, text in enumerate(inputs):
        check_prompt(state.llm, text, f"input {i}")
    with admission(state):
        try:
            result = state.llm.create_embedding(inputs, model=state.model_name)
        except ValueError as exc:  # llama_cpp: an input longer than a batch
            raise BadRequestError(str(exc)) from None
    if encoding == "base64":
        import numpy as np  # here: numpy must not load before llama_cpp (run.py)

        for item in result["data"]:
            vector = np.asarray(item["embedding"], dtype="<f4")
            if vector.ndim != 1:
                raise BadRequestError("the model gives one embedding per token (no pooling): ask for \"float\"")
            item["embedding"] = base64.b64encode(vector.tobytes()).decode("ascii")
    return result


def generate(state: ServerState, create, body: dict, chat: bool):
    """Run ``create(llm, **kwargs)`` for one admitted request; a JSON response, or an SSE stream."""
    kwargs = request_kwargs(state.llm, body, chat)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequestError("'stream' must be true or false")
    with ExitStack() as done:  # undone in reverse: stream closed, timing stopped, stats kept, lock, admission
        done.enter_context(admission(state))
        runner = Runner(state.llm)
        done.callback(record, state, runner)
        done.enter_context(runner.timed())
        try:
            result = create(state.llm, stream=stream, model=state.model_name, **kwargs)
            if stream:
                done.callback(result.close)
                first = next(result, None)  # errors before the first token still get their HTTP status
        except ValueError as exc:  # llama_cpp: a prompt longer than the context, bad arguments
            raise BadRequestError(str(exc)) from None
        if not stream:
            return jsonify(result)
        finish = done.pop_all().close  # idempotent; the stream's end, or the response's close, calls it
    response = Response(sse(result, first, finish), mimetype="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    response.call_on_close(finish)  # also when the stream never started
    return response


def sse(chunks, first, finish):
    """Server-sent events of ``first`` and the rest of ``chunks``, then ``[DONE]``."""
    try:
        chunk = first
        while chunk is not None:
            yield f"data: {json.dumps(chunk)}\n\n"
            chunk = next(chunks, None)
        finish()  # the request's stats are kept (and its slot freed) before the client hears it is done
        yield "data: [DONE]\n\n"
    except Exception as exc:  # the status line is sent: report the error in the stream
        if error_body(exc)[1] >= 500:
            logging.getLogger(__name__).error("generation failed mid-stream", exc_info=exc)
        yield f"data: {json.dumps(error_body(exc)[0])}\n\n"
    finally:  # also on GeneratorExit: the client went away
        finish()


def record(state: ServerState, runner: Runner) -> None:
    if runner.stats.n_requests:
        state.last = runner.stats
        state.total += runner.stats

"""``llamapack.server`` through the official ``openai`` client against live servers on 127.0.0.1."""
from __future__ import annotations

import llama_cpp  # noqa: F401 - before numpy (see docs/hook.md: static C++ runtime)

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
from llamapack.errors import CapacityError, LlamapackError, PackIOError
from llamapack.pack import build_pack
from llamapack.run import open_model
from llamapack.server import create_app
from llamapack.server.wsgi import make_server
from llamapack.synth import write_model

REPO = Path(__file__).resolve().parent.parent
NAME = "tiny"
CHAT = [{"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    model = write_model(tmp_path_factory.mktemp("server") / "m.gguf", "qwen3moe-tiny", seed=0)
    build_pack(model, progress=False, safety_margin_mib=0)
    return model


@pytest.fixture(scope="module")
def llm(model_path):
    with open_model(str(model_path), pack=True, n_ctx=512, n_threads=2, n_threads_batch=2, verbose=False) as llm:
        yield llm


@pytest.fixture
def serve(llm):
    """``serve(**create_app_kwargs)`` starts the production server (waitress, as ``llamapack serve`` does) on a
    free loopback port; its base URL. ``serve.apps`` holds the apps started."""
    servers = []

    def start(**kwargs) -> str:
        app = create_app(llm, model_name=NAME, **kwargs)
        server = make_server(app, "127.0.0.1", 0, queue_size=app.extensions["llamapack"].queue_size,
                             max_body_bytes=app.config["MAX_CONTENT_LENGTH"])
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        servers.append((server, thread))
        start.apps.append(app)
        return f"http://127.0.0.1:{server.port}"

    start.apps = []
    yield start
    for server, thread in servers:
        server.close()
        thread.join(10)


def client(base: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=60)


def direct(llm, prompt, **kw) -> str:
    """The reply ``llm`` gives directly (a prompt string: completion; a message list: chat)."""
    if isinstance(prompt, str):
        return llm.create_completion(prompt, **kw)["choices"][0]["text"]
    return llm.create_chat_completion(prompt, **kw)["choices"][0]["message"]["content"]


def served(api: openai.OpenAI, prompt, stream: bool, model: str = NAME, **kw) -> str:
    """The reply through the server; streams are concatenated."""
    if isinstance(prompt, str):
        result = api.completions.create(model=model, prompt=prompt, stream=stream, **kw)
        return "".join(c.choices[0].text for c in result) if stream else result.choices[0].text
    result = api.chat.completions.create(model=model, messages=prompt, stream=stream, **kw)
    if stream:
        return "".join(c.choices[0].delta.content or "" for c in result if c.choices)
    return result.choices[0].message.content


def raw(base: str, path: str, body: bytes | None = None, key: str | None = None) -> tuple[int, dict, dict]:
    """(status, JSON body, headers) of a plain HTTP request (POST when ``body`` is given)."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    try:
        with urllib.request.urlopen(urllib.request.Request(base + path, data=body, headers=headers), timeout=60) as r:
            return r.status, json.load(r), dict(r.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc), dict(exc.headers)


def assert_openai_error(body: dict, kind: str, code=None) -> None:
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "code"}, body
    assert body["error"]["type"] == kind and body["error"]["code"] == code and body["error"]["message"]


def test_completions_and_chat_match_direct_calls(serve, llm):
    api = client(serve())
    assert [m.id for m in api.models.list()] == [NAME]
    greedy = dict(max_tokens=8, temperature=0)
    for prompt in ("Once upon a time", CHAT):
        expected = direct(llm, prompt, **greedy)
        assert len(expected) > 8
        assert served(api, prompt, False, **greedy) == expected
        assert served(api, prompt, True, **greedy) == expected
    # stop, top_p and seed reach llama_cpp
    expected = direct(llm, "Once upon a time", **greedy)
    stop = expected[len(expected) // 2:len(expected) // 2 + 2]
    assert served(api, "Once upon a time", True, stop=[stop], **greedy) == expected[:expected.index(stop)]
    sampled = dict(max_tokens=8, temperature=1.0, top_p=0.9, seed=7)
    assert served(api, "Once upon a time", False, **sampled) == direct(llm, "Once upon a time", **sampled)


def test_sse_wire_format(serve):
    base = serve()
    request = urllib.request.Request(base + "/v1/completions", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"prompt": "Hi", "max_tokens": 3, "stream": True}).encode())
    with urllib.request.urlopen(request, timeout=60) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events = r.read().decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-2])
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and chunks[0]["model"] == NAME


def test_errors_in_openai_shape(serve):
    base = serve()
    status, body, _ = raw(base, "/v1/chat/completions", b"{not json")
    assert status == 400
    assert_openai_error(body, "invalid_request_error")
    status, body, _ = raw(base, "/v1/chat/completions", json.dumps({"model": NAME}).encode())
    assert status == 400 and "messages" in body["error"]["message"]
    status, body, _ = raw(base, "/v1/completions", json.dumps({"prompt": "x", "temperature": "hot"}).encode())
    assert status == 400 and "temperature" in body["error"]["message"]
    status, body, _ = raw(base, "/v1/nowhere")
    assert status == 404
    assert_openai_error(body, "invalid_request_error")

    api = client(base)
    with pytest.raises(openai.BadRequestError):
        api.chat.completions.create(model=NAME, messages=[])
    with pytest.raises(openai.BadRequestError) as info:  # longer than the context (512)
        api.completions.create(model=NAME, prompt="word " * 600, max_tokens=2)
    assert "601 tokens; the context holds 512" in info.value.response.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as info:  # empty: 400, not 500
        api.completions.create(model=NAME, prompt="", max_tokens=2)
    assert "the prompt is empty" in info.value.response.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as info:
        api.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "word " * 600}])
    assert "the messages are 601 tokens" in info.value.response.json()["error"]["message"]


def test_any_model_name_is_the_one_model(serve, llm):
    api = client(serve())
    greedy = dict(max_tokens=4, temperature=0)
    assert served(api, CHAT, False, model="gpt-4o", **greedy) == direct(llm, CHAT, **greedy)
    assert served(api, "Once", True, model="whatever", **greedy) == direct(llm, "Once", **greedy)
    assert api.models.retrieve("gpt-4o").id == NAME


@pytest.mark.parametrize("error, status, code", [(PackIOError("EIO reading layer 1"), 500, "pack_io_error"),
                                                 (CapacityError("no slot left"), 503, "capacity"),
                                                 (RuntimeError("bug"), 500, None)])
def test_library_errors_map_by_type(serve, llm, monkeypatch, error, status, code):
    def failing(prompt, stream=False, **kw):
        if not stream:
            raise error
        def chunks():  # one good chunk, then the failure: reported inside the stream
            yield {"choices": [{"text": "a", "index": 0, "finish_reason": None}]}
            raise error
        return chunks()

    monkeypatch.setattr(llm, "create_completion", failing)
    base = serve(queue_size=1)
    got, body, _ = raw(base, "/v1/completions", json.dumps({"prompt": "Hi"}).encode())
    assert got == status
    assert_openai_error(body, "server_error", code)
    with urllib.request.urlopen(urllib.request.Request(base + "/v1/completions", headers={"Content-Type": "x"},
                                data=json.dumps({"prompt": "Hi", "stream": True}).encode()), timeout=60) as r:
        events = r.read().decode().split("\n\n")
    assert events[0].startswith("data: ") and events[2:] == [""]
    assert_openai_error(json.loads(events[1].removeprefix("data: ")), "server_error", code)
    monkeypatch.undo()
    assert served(client(base), "Hi", False, max_tokens=2)  # the slot was released


def test_api_key(serve):
    base = serve(api_key="s3cret")
    with pytest.raises(openai.AuthenticationError) as info:
        client(base, "wrong").models.list()
    assert_openai_error(info.value.response.json(), "invalid_request_error", "invalid_api_key")
    with pytest.raises(openai.AuthenticationError):
        client(base, "wrong").completions.create(model=NAME, prompt="Hi", max_tokens=2)
    for path in ("/stats", "/v1/models"):
        assert raw(base, path)[0] == 401
        assert raw(base, path, key="s3cret")[0] == 200
    assert served(client(base, "s3cret"), "Hi", True, max_tokens=2, temperature=0)


def test_queue_full_gets_429(serve, llm, monkeypatch):
    base = serve(queue_size=1)
    entered, release = threading.Event(), threading.Event()
    create_completion = llm.create_completion

    def held(prompt, **kw):
        if prompt == "hold":
            entered.set()
            release.wait(30)
        return create_completion(prompt, **kw)

    monkeypatch.setattr(llm, "create_completion", held)
    results = []
    holder = threading.Thread(target=lambda: results.append(served(client(base), "hold", False, max_tokens=3)))
    holder.start()
    try:
        assert entered.wait(30)
        with pytest.raises(openai.RateLimitError) as info:
            served(client(base), CHAT, False, max_tokens=3)
        assert info.value.response.headers["Retry-After"] == "1"
        assert_openai_error(info.value.response.json(), "rate_limit_error", "queue_full")
    finally:
        release.set()
        holder.join(30)
    assert len(results) == 1
    assert served(client(base), CHAT, False, max_tokens=3)  # the slot is free again


def test_client_disconnect_frees_the_slot(serve, llm):
    base = serve(queue_size=1)
    api = client(base)
    stream = api.completions.create(model=NAME, prompt="Once", max_tokens=450, temperature=0, stream=True)
    next(iter(stream))
    stream.close()  # mid-stream: the server notices at its next write and closes the generation
    deadline = time.monotonic() + 30
    while True:
        stats = raw(base, "/stats")[1]
        if stats["total"]["n_requests"] == 1 and not stats["busy"]:
            break
        assert time.monotonic() < deadline, stats
        time.sleep(0.02)
    assert 0 < stats["last_request"]["n_generated"] < 450  # stopped early, not run to the end
    assert served(api, "Once", False, max_tokens=4, temperature=0) == direct(llm, "Once", max_tokens=4, temperature=0)


def test_stats(serve, llm):
    base = serve()
    served(client(base), "Once upon a time", True, max_tokens=6, temperature=0)
    status, stats, headers = raw(base, "/stats")
    assert status == 200 and headers["Content-Type"] == "application/json"
    last = stats["last_request"]
    assert (last["n_requests"], last["n_generated"], last["n_decoded"]) == (1, 6, 5)
    assert 1 <= last["n_prompt"] <= 4  # 4 tokens, less a prefix the context still holds
    assert last["decode_tok_s"] > 0 and last["read_bytes_per_token"] > 0
    assert stats["total"]["n_requests"] == 1 and stats["busy"] is False and stats["model"] == NAME
    pack = stats["pack"]
    assert 0 <= pack["hit_rate"] <= 1 and pack["n_slots"] > 0 and set(pack) >= set(llm.pack_stats()) - {"hit_rate"}


N_CLIENTS = 16


def test_concurrent_clients(serve, llm):
    """16 clients x 2 short requests at once: each gets 200 or 429; every 200 is that prompt's own reply."""
    base = serve(queue_size=4)
    prompts = ["Once upon a time", "The cat", [{"role": "user", "content": "Hello"}], CHAT]
    greedy = dict(max_tokens=5, temperature=0)
    expected = [direct(llm, p, **greedy) for p in prompts]
    assert len(set(expected)) == len(prompts)
    start, outcomes = threading.Barrier(N_CLIENTS), []

    def worker(i):
        api = client(base)
        start.wait()
        for j in range(2):
            k = (i + j) % len(prompts)
            try:
                outcomes.append((k, served(api, prompts[k], (i + j) % 2 == 0, **greedy)))
            except openai.RateLimitError:
                outcomes.append((k, 429))
            except Exception as exc:  # noqa: BLE001 - reported below
                outcomes.append((k, exc))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(N_CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(outcomes) == 2 * N_CLIENTS
    answered = [(k, text) for k, text in outcomes if text != 429]
    assert all(text == expected[k] for k, text in answered), outcomes
    assert answered and len(answered) < 2 * N_CLIENTS  # some served, some refused
    assert raw(base, "/stats")[1]["total"]["n_requests"] == len(answered)


def test_serve_command(model_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "llamapack", "serve", str(model_path), "--pack", "--port", str(port),
                             "-c", "256", "--api-key", "k"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        api = client(f"http://127.0.0.1:{port}", "k")
        deadline = time.monotonic() + 60
        while True:
            try:
                models = api.models.list()
                break
            except openai.APIConnectionError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
                time.sleep(0.1)
        assert [m.id for m in models] == ["m.gguf"]
        assert served(api, "Hi", True, "m.gguf", max_tokens=3, temperature=0)
    finally:
        proc.terminate()
        proc.wait(30)


def test_serve_command_errors(tmp_path):
    from click.testing import CliRunner

    from llamapack.cli import main

    result = CliRunner().invoke(main, ["serve", str(tmp_path / "missing.gguf")])
    assert result.exit_code == 1 and result.stderr.startswith("Error: GGUF file not found")


def test_chat_page_is_served_without_key(serve):
    """The page only (it is not exercised in a browser here): no key needed, nothing loaded from elsewhere."""
    base = serve(api_key="k")
    with urllib.request.urlopen(base + "/", timeout=60) as r:
        assert r.headers["Content-Type"].startswith("text/html")
        page = r.read().decode()
    assert "/v1/chat/completions" in page and "/stats" in page
    assert "http://" not in page and "https://" not in page


def test_api_key_must_not_be_empty(llm, tmp_path):
    for key in ("", "  "):
        with pytest.raises(LlamapackError, match="the API key is empty"):
            create_app(llm, api_key=key)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "llamapack", "serve", str(tmp_path / "m.gguf"), "--api-key", ""],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 1 and proc.stderr.startswith("Error: --api-key is empty") and proc.stderr.count("\n") == 1


def test_body_over_the_limit_gets_413(serve):
    base = serve(max_body_bytes=4096)
    status, body, _ = raw(base, "/v1/completions", json.dumps({"prompt": "x" * 5000, "max_tokens": 2}).encode())
    assert status == 413
    assert_openai_error(body, "invalid_request_error")
    status, _, _ = raw(base, "/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 2}).encode())
    assert status == 200


def test_prompts_are_checked_before_waiting_for_the_generation(serve, llm):
    """While a generation holds the lock, a prompt too long for the context is answered 400 at once."""
    base = serve()
    lock = serve.apps[-1].extensions["llamapack"].lock
    with lock:
        started = time.monotonic()
        status, body, _ = raw(base, "/v1/completions", json.dumps({"prompt": "word " * 600}).encode())
        assert status == 400 and "601 tokens" in body["error"]["message"]
        status, body, _ = raw(base, "/v1/chat/completions", json.dumps(
            {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}}
        ).encode())
        assert status == 400 and "response_format" in body["error"]["message"]
        assert time.monotonic() - started < 10


@pytest.mark.parametrize("extra, field", [({"n": 2}, "n=1"), ({"best_of": 3}, "best_of=1"),
                                          ({"frobnicate": True}, "'frobnicate' is not supported"),
                                          ({"logit_bias": {"999999999": 1}}, "logit_bias"),
                                          ({"grammar": "root ::= ("}, "'grammar'"),
                                          ({"temperature": float("nan")}, "'temperature'"),
                                          ({"top_k": 2.5}, "'top_k'")])
def test_unsupported_or_bad_fields_get_400_naming_them(serve, extra, field):
    base = serve()
    status, body, _ = raw(base, "/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 2, **extra}).encode())
    assert status == 400 and field in body["error"]["message"], body


def test_llama_cpp_parameters_reach_the_model(serve, llm):
    api = client(serve())
    greedy = dict(max_tokens=6, temperature=0)
    plain = direct(llm, CHAT, **greedy)
    assert not plain.lstrip().startswith("{")
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}
    for response_format in ({"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}):
        reply = served(api, CHAT, False, response_format=response_format, **greedy)
        assert reply.lstrip().startswith("{"), reply
    extra = dict(top_k=1, min_p=0.1, repeat_penalty=1.3)
    assert served(api, "Once upon a time", False, **greedy, extra_body=extra) == \
        direct(llm, "Once upon a time", **greedy, **extra)
    result = api.completions.create(model=NAME, prompt="Once", max_tokens=10**6, temperature=0)
    assert result.usage.completion_tokens <= 512  # capped by the context


def test_idle_connections_take_no_threads(serve):
    base = serve()
    host, port = base.removeprefix("http://").split(":")
    before = threading.active_count()
    sockets = []
    try:
        for _ in range(50):  # half-sent requests: waitress keeps them on its event loop, not on threads
            s = socket.create_connection((host, int(port)))
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
            sockets.append(s)
        time.sleep(0.5)
        assert threading.active_count() == before
        status, _, _ = raw(base, "/v1/models")
        assert status == 200
    finally:
        for s in sockets:
            s.close()


@pytest.fixture(scope="module")
def embedder(model_path):
    with open_model(str(model_path), pack=True, n_ctx=256, n_threads=2, verbose=False, embedding=True,
                    pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN) as llm:
        yield llm


def test_embeddings(llm, embedder):
    app = create_app(embedder, model_name=NAME)
    server = make_server(app, "127.0.0.1", 0, queue_size=4, max_body_bytes=1 << 20)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{server.port}"
        expected = embedder.create_embedding(["Hello there", "bye"])["data"]
        result = client(base).embeddings.create(model="any", input=["Hello there", "bye"])  # base64 on the wire
        assert [list(map(float, d.embedding)) for d in result.data] == \
            [pytest.approx(e["embedding"], rel=0, abs=0) for e in expected]
        status, body, _ = raw(base, "/v1/embeddings", json.dumps({"input": "Hello there"}).encode())
        assert status == 200 and body["data"][0]["embedding"] == expected[0]["embedding"]
        status, body, _ = raw(base, "/v1/embeddings", json.dumps({"input": ""}).encode())
        assert status == 400 and "input 0 is empty" in body["error"]["message"]
    finally:
        server.close()
        thread.join(10)
    app = create_app(llm, model_name=NAME)  # loaded without embeddings: refused, naming the switch
    with app.test_client() as http:
        response = http.post("/v1/embeddings", json={"input": "Hi"})
    assert response.status_code == 400 and "--embedding" in response.get_json()["error"]["message"]

"""What a request may ask of the model: its OpenAI fields, checked and turned into llama_cpp keyword arguments.

Every field is forwarded (checked here, before the request is queued), ignored on purpose (``IGNORED``: it
changes no token), or refused (InputError, answered 400, naming the field): an unknown field, or one this
server does not implement (``n`` or ``best_of`` above 1). ``max_tokens`` is capped by the context size.
``response_format`` ``json_object`` (with an optional ``schema``) and ``json_schema`` constrain the reply
with llama.cpp's grammar; a grammar or schema it cannot parse is refused here (llama_cpp would loosen a bad
schema to any JSON, and a bad grammar fails inside llama.cpp).
"""
from __future__ import annotations

import json
import math

from ..errors import InputError

IGNORED = {"model", "stream", "user", "metadata", "store", "service_tier", "stream_options", "parallel_tool_calls"}
MAX_STOP = 16


def _number(lo: float, hi: float, integer: bool = False):
    def check(name, value):
        kind = int if integer else (int, float)
        if isinstance(value, bool) or not isinstance(value, kind) or not (math.isfinite(value) and lo <= value <= hi):
            raise InputError(f"'{name}' must be {'an integer' if integer else 'a number'} in [{lo}, {hi}]")
        return value
    return check


def _flag(name, value):
    if not isinstance(value, bool):
        raise InputError(f"'{name}' must be true or false")
    return value


def _text(name, value):
    if not isinstance(value, str):
        raise InputError(f"'{name}' must be a string")
    return value


def _stop(name, value):
    stop = [value] if isinstance(value, str) else value
    if not (isinstance(stop, list) and len(stop) <= MAX_STOP and all(isinstance(s, str) and s for s in stop)):
        raise InputError(f"'{name}' must be a non-empty string or a list of at most {MAX_STOP} of them")
    return stop


def _one(name, value):
    if value != 1:
        raise InputError(f"only {name}=1 is supported")
    return None


def _response_format(name, value):
    """The llama_cpp form: None (text), or {"type": "json_object"[, "schema": S]}."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        schema = value.get("schema")
    elif kind == "json_schema" and isinstance(value.get("json_schema"), dict):
        schema = value["json_schema"].get("schema")
    else:
        raise InputError(f"'{name}' must be {{\"type\": \"text\" | \"json_object\" | \"json_schema\"}} "
                         "(json_schema with a \"json_schema\": {\"schema\": ...} object)")
    return {"type": "json_object"} if schema is None else {"type": "json_object", "schema": schema}


def check_grammar(llm, name: str, text: str) -> None:
    """InputError unless llama.cpp parses the GBNF ``text`` (a grammar it cannot parse would fail in C later)."""
    import llama_cpp

    sampler = llama_cpp.llama_sampler_init_grammar(llm._model.vocab, text.encode("utf-8"), b"root")
    if not sampler:
        raise InputError(f"'{name}' is not a grammar llama.cpp can parse")
    llama_cpp.llama_sampler_free(sampler)


def _grammars(llm, kwargs: dict) -> None:
    """Check the request's grammar (``grammar`` GBNF, or a ``response_format`` schema) before it is queued."""
    from llama_cpp.llama_grammar import LlamaGrammar, json_schema_to_gbnf

    if "grammar" in kwargs:
        check_grammar(llm, "grammar", kwargs["grammar"])
        kwargs["grammar"] = LlamaGrammar.from_string(kwargs["grammar"], verbose=False)
    schema = kwargs.get("response_format", {}).get("schema")
    if schema is not None:
        try:
            text = json_schema_to_gbnf(json.dumps(schema))
        except Exception as exc:  # noqa: BLE001 - whatever the converter rejects is the request's fault
            raise InputError(f"'response_format' has a JSON schema llama.cpp cannot use: {exc}") from None
        check_grammar(llm, "response_format", text)


def _tools(name, value):
    if not (isinstance(value, list) and all(isinstance(t, dict) for t in value)):
        raise InputError(f"'{name}' must be a list of objects")
    return value


def _choice(name, value):
    if not isinstance(value, (str, dict)):
        raise InputError(f"'{name}' must be a string or an object")
    return value


SAMPLING = {
    "max_tokens": _number(1, 1 << 31, integer=True),
    "temperature": _number(0, 2),
    "top_p": _number(0, 1),
    "min_p": _number(0, 1),
    "typical_p": _number(0, 1),
    "top_k": _number(0, 1 << 31, integer=True),
    "seed": _number(0, (1 << 63) - 1, integer=True),
    "frequency_penalty": _number(-2, 2),
    "presence_penalty": _number(-2, 2),
    "repeat_penalty": _number(0, 100),
    "tfs_z": _number(0, 1),
    "mirostat_mode": _number(0, 2, integer=True),
    "mirostat_tau": _number(0, 100),
    "mirostat_eta": _number(0, 1),
    "stop": _stop,
    "grammar": _text,
    "n": _one,
}
COMPLETION = {**SAMPLING, "echo": _flag, "logprobs": _number(0, 20, integer=True), "suffix": _text, "best_of": _one}
CHAT = {**SAMPLING, "logprobs": _flag, "top_logprobs": _number(0, 20, integer=True),
        "response_format": _response_format, "tools": _tools, "tool_choice": _choice, "functions": _tools,
        "function_call": _choice, "max_completion_tokens": SAMPLING["max_tokens"]}


def _logit_bias(value, n_vocab: int) -> dict[int, float]:
    if not isinstance(value, dict):
        raise InputError("'logit_bias' must be an object of token id -> bias")
    bias = {}
    for key, amount in value.items():
        try:
            token = int(key)
        except ValueError:
            token = -1
        if not 0 <= token < n_vocab:
            raise InputError(f"'logit_bias' key {key!r} is not a token id in [0, {n_vocab})")
        bias[token] = float(_number(-100, 100)(f"logit_bias[{key}]", amount))
    return bias


def request_kwargs(llm, body: dict, chat: bool) -> dict:
    """llama_cpp keyword arguments for the fields of ``body`` besides the prompt or messages."""
    fields = CHAT if chat else COMPLETION
    kwargs = {}
    for name, value in body.items():
        if name in IGNORED or name == ("messages" if chat else "prompt") or value is None:
            continue
        if name == "logit_bias":
            kwargs[name] = _logit_bias(value, llm.n_vocab())
            continue
        if name not in fields:
            raise InputError(f"'{name}' is not supported by this server")
        checked = fields[name](name, value)
        if checked is not None:
            kwargs[name] = checked
    if "max_completion_tokens" in kwargs:
        kwargs.setdefault("max_tokens", kwargs["max_completion_tokens"])
        del kwargs["max_completion_tokens"]
    if "max_tokens" in kwargs:
        kwargs["max_tokens"] = min(kwargs["max_tokens"], llm.n_ctx())
    _grammars(llm, kwargs)
    return kwargs

"""Seeded generators of malformed request bodies, by category, for the queue, the engine and the OpenAI proxy.

Each generator yields `(category, content_type, body)`; every body is invalid (no valid request hides in
the corpus), so the only right answer is a 4xx with a message. Bodies stay small (< 64 KiB) except where a
category is about size; "huge declared lengths" declare gigabytes in a few bytes.
"""

from __future__ import annotations

import json
import random
import struct
from collections.abc import Iterator
from typing import Any

import msgspec

MP, JS = "application/msgpack", "application/json"
_mp = msgspec.msgpack.Encoder()


def _json(obj: Any) -> bytes:
    return json.dumps(obj, allow_nan=True).encode()


def huge_msgpack_headers(rng: random.Random) -> bytes:
    """A msgpack value whose header declares far more data than follows."""
    n = rng.choice([2**31, 2**32 - 1, 10**9, 2**20])
    kind = rng.choice([b"\xdd", b"\xdf", b"\xc6", b"\xdb"])  # array32, map32, bin32, str32
    return kind + struct.pack(">I", n) + rng.randbytes(rng.randint(0, 16))


def deep(depth: int, leaf: Any = 1, as_list: bool = True) -> Any:
    out = leaf
    for _ in range(depth):
        out = [out] if as_list else {"a": out}
    return out


def deep_json(depth: int) -> bytes:
    return b'{"id":"d","response_ids":[1],"metadata":' + b'{"a":' * depth + b"1" + b"}" * depth + b"}"


def deep_msgpack(depth: int) -> bytes:
    # map{"id": "d", "response_ids": [1], "metadata": {"a": {"a": ... }}} built without recursion limits
    inner = b"\x01"
    for _ in range(depth):
        inner = b"\x81\xa1a" + inner
    return b"\x83\xa2id\xa1d\xacresponse_ids\x91\x01\xa8metadata" + inner


def queue_bodies(rng: random.Random, n_per_category: int) -> Iterator[tuple[str, str, bytes]]:
    """Malformed `POST /v1/trajectories` bodies (no tokenizer on the server, so no vocabulary bound)."""
    good = {"id": "x", "prompt_ids": [1, 2], "response_ids": [3, 4, 5], "reward": 1.0}
    good_mp = _mp.encode(good)
    for _ in range(n_per_category):
        yield "invalid-msgpack", MP, rng.randbytes(rng.randint(1, 200))
        cut = rng.randint(0, len(good_mp) - 1)
        yield "invalid-msgpack", MP, good_mp[:cut] or b"\xc1"
        yield "invalid-msgpack", MP, good_mp + rng.randbytes(rng.randint(1, 8))  # trailing bytes
        text = _json(good).decode()
        yield "invalid-json", JS, text[: rng.randint(0, len(text) - 1)].encode() or b"{"
        yield (
            "invalid-json",
            JS,
            rng.choice([b"{'id': 'x'}", b"[1,2,,]", b"nul", b'{"id": "x",}', b"\xff\xfe{"]),
        )
        yield "invalid-json", JS, rng.randbytes(rng.randint(1, 120))
        field, value = rng.choice([("id", 7), ("id", None), ("response_ids", "abc"), ("response_ids", {"a": 1}),
                                   ("reward", "high"), ("versions", {"0": 3}), ("metadata", [1, 2]),
                                   ("loss_mask", 1.5), ("status", "maybe"), ("turn_rewards", "x"),
                                   ("created_at", "today"), ("unknown_field", 1), ("prompt_ids", [1.5]),
                                   ("response_ids", [[1, 2]]), ("policy_version", "v1")])  # fmt: skip
        bad = {**good, field: value}
        ctype = rng.choice([MP, JS])
        yield "wrong-types", ctype, (_mp.encode(bad) if ctype == MP else _json(bad))
        yield (
            "wrong-types",
            rng.choice([MP, JS]),
            rng.choice([b"3", b'"x"', b"[1,2]", b"null"])
            if rng.random() < 0.5
            else _mp.encode(rng.choice([3, "x", [1], None])),
        )
        yield "huge-length", MP, huge_msgpack_headers(rng)
        yield "huge-length", MP, _mp.encode({**good, "response_ids": b""})[:-1] + b"\xc6\xff\xff\xff\xf0"
        yield "huge-length", JS, _json({**good, "response_ids": [2 ** rng.randint(31, 70)]})
        nan = rng.choice([float("nan"), float("inf"), float("-inf")])
        field = rng.choice(["reward", "created_at", "finished_at"])
        ctype = rng.choice([MP, JS])
        bad = {**good, field: nan}
        yield "nan-inf", ctype, _mp.encode(bad) if ctype == MP else _json(bad)
        lp = [-0.1, nan, -0.2]
        yield "nan-inf", MP, _mp.encode({**good, "logprobs": struct.pack("<3f", *lp)})
        yield "nan-inf", MP, _mp.encode({**good, "turn_rewards": [0.0, nan]})
        k = rng.choice([1, 2, 4, 5])
        field = rng.choice(["loss_mask", "logprobs"])
        values = [1] * k if field == "loss_mask" else [-0.5] * k
        yield "mismatched-lengths", rng.choice([MP, JS]), _mp.encode({**good, field: values})
        yield "mismatched-lengths", MP, _mp.encode({**good, "versions": [[0, k]]})
        yield "mismatched-lengths", MP, _mp.encode({**good, "response_ids": b"\x01\x00\x00"})  # 3 bytes
        yield "deep-nesting", JS, deep_json(rng.randint(1_000, 50_000))
        yield "deep-nesting", MP, deep_msgpack(rng.randint(1_000, 50_000))
        yield "deep-nesting", JS, b"[" * rng.randint(10_000, 60_000)
        bad_utf8 = rng.choice([b"\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"a\x80"])
        yield (
            "odd-unicode",
            MP,
            b"\x82\xa2id" + bytes([0xA0 | len(bad_utf8)]) + bad_utf8 + b"\xacresponse_ids\x91\x01",
        )
        yield "odd-unicode", JS, b'{"id": "' + bad_utf8 + b'", "response_ids": [1]}'
        surrogate = rng.choice(["\\ud800", "\\udfff", "\\ud83d"])
        yield "odd-unicode", JS, ('{"id": "a' + surrogate + '", "response_ids": []}').encode()
        yield (
            "odd-unicode",
            JS,
            ('{"id": "' + "\u202e\u0000" * 40 + '", "response_ids": [1]}').encode() + b"\x00",
        )
        yield "empty", rng.choice([MP, JS]), b""  # (an empty list is a valid no-op: 202, accepted 0)
        int64 = struct.pack("<3q", *(rng.randrange(1, 1000) for _ in range(3)))  # dtype left to a guess
        yield "nonsense", MP, _mp.encode({**good, "response_ids": int64})
        yield "nonsense", MP, _mp.encode({**good, "response_ids": {"dtype": "float32", "data": int64[:12]}})
        yield "nonsense", rng.choice([MP, JS]), _mp.encode({**good, "logprobs": [-0.5, -1e30, -0.1]})
        yield "nonsense", JS, _json({**good, "policy_version": rng.randint(1, 10**6)})  # not published yet
        wizard = [{"role": "user", "content": "x"}, {"role": "wizard", "content": "y"}]
        yield "nonsense", JS, _json({"id": "w", "messages": wizard})
        yield "nonsense", JS, _json({**good, "metadata": {"n": 2 ** rng.randint(64, 200)}})


def engine_bodies(rng: random.Random, n_per_category: int) -> Iterator[tuple[str, str, bytes]]:
    """Malformed `POST /generate` bodies for `agentrl serve-engine` (JSON)."""
    good = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
    for _ in range(n_per_category):
        text = _json(good).decode()
        yield "invalid-json", JS, text[: rng.randint(0, len(text) - 1)].encode() or b"{"
        yield "invalid-json", JS, rng.randbytes(rng.randint(1, 120))
        field, value = rng.choice([("input_ids", "hello"), ("input_ids", [1.5]), ("input_ids", [[1]]),
                                   ("sampling_params", 3), ("return_logprob", "yes"), ("rid", 5),
                                   ("input_ids", None), ("input_ids", [])])  # fmt: skip
        yield "wrong-types", JS, _json({**good, field: value})
        sp_field, sp_value = rng.choice([("temperature", "hot"), ("max_new_tokens", -3), ("max_new_tokens", 0),
                                         ("top_p", 7.0), ("top_k", "x"), ("stop_token_ids", "x"),
                                         ("bogus", 1)])  # fmt: skip
        yield "wrong-types", JS, _json({**good, "sampling_params": {sp_field: sp_value}})
        yield "huge-length", JS, _json({**good, "input_ids": [1] * rng.randint(3000, 6000)})  # > max_seq_len
        yield "huge-length", JS, _json({**good, "input_ids": [2 ** rng.randint(31, 70)]})
        yield (
            "huge-length",
            JS,
            _json({**good, "input_ids": [rng.randint(10**6, 10**8)]}),
        )  # outside the vocab
        yield "huge-length", JS, _json({**good, "input_ids": [-rng.randint(1, 10**6)]})
        nan = rng.choice(["NaN", "Infinity", "-Infinity"])
        key = rng.choice(["temperature", "top_p"])
        yield "nan-inf", JS, f'{{"input_ids": [1], "sampling_params": {{"{key}": {nan}}}}}'.encode()
        yield "deep-nesting", JS, b'{"input_ids": ' + b"[" * rng.randint(1_000, 50_000)
        yield (
            "deep-nesting",
            JS,
            b'{"input_ids": [1], "sampling_params": ' + b'{"a":' * rng.randint(1000, 20000),
        )
        bad_utf8 = rng.choice([b"\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"a\x80"])
        yield "odd-unicode", JS, b'{"input_ids": [1], "rid": "' + bad_utf8 + b'"}'
        yield "odd-unicode", JS, b'{"input_ids": [1], "rid": "\\udc00"}'
        yield "mismatched-lengths", JS, _json({"names": ["a", "b"], "dtypes": ["float32"], "shapes": [[1]],
                                               "group_name": "g"})  # fmt: skip


def proxy_bodies(rng: random.Random, n_per_category: int) -> Iterator[tuple[str, str, bytes]]:
    """Malformed chat-completion bodies for the OpenAI proxy (JSON)."""
    msgs = [{"role": "user", "content": "What is 2+3?"}]
    good = {"model": "m", "messages": msgs, "max_tokens": 2}
    for _ in range(n_per_category):
        text = _json(good).decode()
        yield "invalid-json", JS, text[: rng.randint(0, len(text) - 1)].encode() or b"{"
        yield "invalid-json", JS, rng.randbytes(rng.randint(1, 120))
        field, value = rng.choice([("messages", "hi"), ("messages", [{"role": 3}]), ("messages", []),
                                   ("messages", [{"role": "wizard", "content": "x"}]), ("max_tokens", "ten"),
                                   ("max_tokens", 0), ("temperature", "hot"), ("n", 0), ("stream", "yes"),
                                   ("stop", [3]), ("top_p", -1), ("seed", 1.5)])  # fmt: skip
        yield "wrong-types", JS, _json({**good, field: value})
        yield (
            "huge-length",
            JS,
            _json({**good, "messages": [{"role": "user", "content": "7" * rng.randint(5000, 20000)}]}),
        )
        # past a signed 64-bit integer (a smaller budget than the context left is capped, not refused)
        yield "huge-length", JS, _json({**good, "max_tokens": 2 ** rng.randint(64, 70)})
        nan = rng.choice(["NaN", "Infinity", "-Infinity"])
        yield (
            "nan-inf",
            JS,
            f'{{"model": "m", "messages": [{{"role": "user", "content": "x"}}], "temperature": {nan}}}'.encode(),
        )
        yield "deep-nesting", JS, b'{"model": "m", "messages": ' + b"[" * rng.randint(1000, 50000)
        yield (
            "deep-nesting",
            JS,
            b'{"model": "m", "messages": [{"role": "user", "content": ' + b'{"a":' * rng.randint(1000, 20000),
        )
        bad_utf8 = rng.choice([b"\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"a\x80"])
        yield (
            "odd-unicode",
            JS,
            b'{"model": "m", "messages": [{"role": "user", "content": "' + bad_utf8 + b'"}]}',
        )
        yield "odd-unicode", JS, b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}'

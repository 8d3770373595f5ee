"""Shared by the SDK tests (tests/test_openai_sdk.py, tests/test_anthropic_sdk.py): a live proxy on loopback
over a given engine, SDK clients per session (`openai` and `anthropic`), and the check that a recorded
trajectory is exactly the conversation the SDK saw, with the mask on the model's tokens only."""

import aiohttp
import openai

from agentrl.chat import chat_tokens
from agentrl.engines.base import SamplingParams
from agentrl.engines.embedded import EmbeddedEngine
from agentrl.engines.tiny import CHAT_TEMPLATE
from agentrl.proxy.server import OpenAIProxy
from agentrl.types import mask, tokens

Q = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "What is 2+3?"}]
TOOLS = [
    {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "mul", "parameters": {"type": "object", "properties": {}}}},
]  # fmt: skip
# the openai SDK's chat.completions.stream parses the calls of strict tools only
STRICT_TOOLS = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
# Qwen3's treatment of reasoning, on the shipped template: an assistant turn before the last user message
# is rendered without its `<think>...</think>` part
REASONING_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
) + CHAT_TEMPLATE.replace(
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') }}",
    "{%- set content = message['content'] or '' %}"
    "{%- if message['role'] == 'assistant' and '</think>' in content and loop.index0 < ns.last_user %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content }}",
)


class Seeing(EmbeddedEngine):
    """The embedded engine, keeping what each request gave it: `seen` holds each request's input ids and
    pictures, in arrival order (what the proxy sent on)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.seen: list[tuple[list[int], list]] = []

    async def generate(self, input_ids, sampling, request_id=None, images=None, **kw):
        self.seen.append((list(input_ids), list(images or [])))
        return await super().generate(input_ids, sampling, request_id=request_id, images=images, **kw)


class Live:
    """A proxy on loopback, an SDK client per session, and the trajectories it closes."""

    def __init__(self, engine, tok, **kw):
        self.sunk, self.tok, self.clients = [], tok, []

        async def sink(trajs):
            self.sunk += trajs

        self.proxy = OpenAIProxy([engine], tok, sink=sink, sampling=SamplingParams(max_new_tokens=160), **kw)

    async def __aenter__(self):
        self.url = await self.proxy.start()
        return self

    async def __aexit__(self, *exc):
        for client in self.clients:
            await client.close()
        await self.proxy.stop()

    def client(self, sid):
        client = openai.AsyncOpenAI(base_url=f"{self.url}/v1/sessions/{sid}", api_key="unused", max_retries=0)
        self.clients.append(client)
        return client

    def anthropic(self, sid):
        import anthropic  # only the Anthropic tests need it (they importorskip it)

        client = anthropic.AsyncAnthropic(
            base_url=f"{self.url}/v1/sessions/{sid}", api_key="unused", max_retries=0
        )
        self.clients.append(client)
        return client

    async def close(self, sid, reward=1.0):
        url = f"{self.url}/v1/sessions/{sid}/reward"
        async with aiohttp.ClientSession() as http, http.post(url, json={"reward": reward}) as resp:
            assert resp.status == 200, await resp.text()
        return [t for t in self.sunk if t.metadata["session_id"] == sid]

    async def health(self):
        async with aiohttp.ClientSession() as http, http.get(f"{self.url}/health") as resp:
            return await resp.json()


def assert_recorded(tok, traj, conversation, tools=None):
    """The trajectory decodes to the template's rendering of `conversation` (all it has, up to the last
    end-of-turn), and its mask is 1 exactly on the assistant replies' tokens."""
    prompt, response = tokens(traj.prompt_ids).tolist(), tokens(traj.response_ids).tolist()
    rendered = tok.apply_chat_template(conversation, tools=tools, tokenize=False)
    assert tok.decode(prompt + response, skip_special_tokens=False) + "\n" == rendered
    chat = chat_tokens(tok)
    trained = [t for t, m in zip(response, mask(traj).tolist(), strict=True) if m]
    replies = [m for m in conversation[1:] if m["role"] == "assistant"]
    expected = "".join(
        tok.apply_chat_template([{"role": "user", "content": ""}, r], tools=None, tokenize=False)[
            len("<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n") : -1
        ]
        for r in replies
    )
    assert tok.decode(trained, skip_special_tokens=False) == expected  # replies + their end-of-turn only
    assert trained.count(chat.eot_id) == len(replies)


def sent(message):
    """An SDK response message as an agent appends it to its history."""
    return message.model_dump(exclude_none=True)

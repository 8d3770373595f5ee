"""The default agent of the `openai_proxy` generator: it plays an agentrl env through the proxy's
OpenAI-compatible HTTP API (plain aiohttp, as any external agent would), so every env also runs through the
proxy path. An agent is `async (base_url, task, env) -> reward`; one that takes `api_key` is given the proxy's
bearer token when `rollout.proxy_token` is set (agentrl.generators.openai_proxy.agent_keywords).
"""

from __future__ import annotations

from typing import Any

import aiohttp

from agentrl.envs.base import AgentEnv
from agentrl.errors import AgentRLError


async def env_agent(base_url: str, task: dict[str, Any], env: AgentEnv, api_key: str = "") -> float:
    messages = [{"role": m.role, "content": m.content} for m in await env.reset(task)]
    total, info = 0.0, {}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession(headers=headers) as http:
        for _ in range(max(1, env.max_turns)):
            async with http.post(f"{base_url}/chat/completions", json={"messages": messages}) as resp:
                body = await resp.json()
                if resp.status != 200:
                    raise AgentRLError(f"openai proxy answered {resp.status}: {body}")
            choice = body["choices"][0]
            text = choice["message"]["content"]
            messages.append({"role": "assistant", "content": text})
            result = await env.step(text)
            total += result.reward
            info = result.info
            if result.done or choice["finish_reason"] == "length":
                break
            messages += [{"role": m.role, "content": m.content} for m in result.messages]
    return episode_reward(total, info)


def episode_reward(total: float, info: dict[str, Any]) -> float:
    """An env episode's reward: the env's own `info["episode_reward"]` when it reports one, else the sum of
    its step rewards (also the rule of the `external` generator's env steps)."""
    return float(info.get("episode_reward", total))

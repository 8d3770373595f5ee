"""Rollout programs (generators): async functions `generate(ctx, task, trajectory_id, group_id) -> Trajectory`
that drive an env against an engine. Named in the config as `rollout.generator`:

- `single_turn`: chat-templated prompt -> one reply -> env.step.
- `multi_turn`: env.reset -> generate -> env.step -> ... with token-in/token-out (agentrl/chat.py).
- `openai_proxy`: an OpenAI-compatible HTTP server in front of the engines that records each session's
  tokens, so an agent written against the OpenAI SDK is trained unchanged.
- anything else: `package.module:function`.

This package is resolved by name at run time (agentrl.generator.resolve_generator); nothing in agentrl
imports it statically.
"""

"""Rollout programs (generators): async functions `generate(ctx, task, trajectory_id, group_id) -> Trajectory`
that drive an env against an engine. Named in the config as `rollout.generator`:

- `single_turn`: chat-templated prompt -> one reply -> env.step.
- `multi_turn`: env.reset -> generate -> env.step -> ... with token-in/token-out (agentrl/chat.py).
- `openai_proxy`: an agent plays each episode against the worker's OpenAI-compatible proxy
  (agentrl.proxy), which records the session's tokens, so an agent written against an SDK is trained
  unchanged; `external`: agent processes outside Ray claim the tasks over HTTP and play them the same way.
- `self_play`: one game of a multi-seat env, one trajectory per seat.
- anything else: `package.module:function`.

This package is resolved by name at run time (agentrl.generator.resolve_generator); nothing in agentrl
imports it statically.
"""

"""`multi_turn`: env.reset -> engine.generate -> env.step -> ... with token-in/token-out.

Invariants of the trajectory this returns:
- `prompt_ids` are the chat-templated opening messages (generation prompt included); `response_ids` are
  everything after: each model reply exactly as generated, then the template delta for the env's feedback
  (see agentrl/chat.py). Turn k's engine input is prompt + response so far, so decoding
  prompt + response reproduces the conversation, and no earlier token is ever re-tokenized.
- `loss_mask` is 1 on model tokens and 0 on env/tool tokens; `logprobs` hold the engine's logprobs on model
  tokens and 0.0 on env tokens; `versions` cover every response token: model tokens carry the policy version
  the engine reported, env tokens the version of the model token before them.
- `turn_rewards[k]` is the reward of env.step k; `reward` is `info["episode_reward"]` of the final step when
  the env sets it, else the sum of turn rewards.
- status: `completed` when the env said done; `truncated` when a reply hit max_new_tokens (length),
  `max_turns` ran out, or the next turn would exceed `max_seq_len`; `aborted` when the engine aborted the
  request and continuing was not possible. An aborted request (weight update in `abort` mode) is continued from
  its partial output up to `ctx.abort_retries` (`rollout.abort_retries`) times, so the reply spans two versions; a
  piece aborted before it produced a token (it was queued) adds nothing to the record and is simply re-sent.
- engine request ids: `<prefix>.t<turn>.<piece>`, `piece` counting the requests sent for that turn (0, then 1,
  2, ... for continuations after aborts; counted per `TokenLog`, never rolled back), so no id is sent twice:
  SGLang keeps the id of a request aborted while queued registered and refuses it again ("Duplicate request ID
  detected"). `prefix` is `ctx.request_prefix` (the rollout worker makes it new for every attempt),
  else the trajectory id.
- `routed_experts` (rollout routing replay, when `ctx.sampling.return_routed_experts` and the engine reports
  them): each position's experts come from the first request that ran a forward on it, so a reply's own
  positions keep the routing they were sampled with (docs/moe.md, "Routing replay data"). A reply that comes
  back without a record leaves the trajectory without one (the learner routes it itself).
- images (a vision-language model): the env's messages may hold image parts; each image's placeholder is
  expanded into its tokens (agentrl.chat `place_images`), the picture is stored once in `images` and placed by
  `image_spans`, and every engine request carries the pictures of its input in the order they appear.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from agentrl.chat import chat_tokens
from agentrl.generator import RolloutContext
from agentrl.turns import TokenLog, generate_turn, turn_sampling
from agentrl.types import Status, Trajectory, message_images


async def run_episode(
    ctx: RolloutContext, task: dict[str, Any], trajectory_id: str, group_id: str, max_turns: int
) -> Trajectory:
    chat = chat_tokens(ctx.tokenizer)
    sampling = turn_sampling(ctx)
    prefix = ctx.request_prefix or trajectory_id
    created_at = time.time()
    env = ctx.make_env()
    turn_rewards: list[float] = []
    finish_reasons: list[str] = []
    info: dict[str, Any] = {}
    status: Status = "truncated"
    try:
        opening = await env.reset(task)
        prompt, spans = chat.place_images(
            chat.prompt_ids(opening, chat_template=task.get("apply_chat_template", True)), opening
        )
        log = TokenLog(prompt)
        log.add_images(0, spans, message_images(opening))
        for turn in range(max_turns):
            if len(log) >= ctx.max_seq_len:
                break
            out, reply = await generate_turn(ctx, log, sampling, f"{prefix}.t{turn}")
            if out.finish_reason == "abort":
                status = "aborted"
                if reply:  # a turn that never got a token is no turn
                    finish_reasons.append("abort")
                break
            finish_reasons.append(out.finish_reason)
            result = await env.step(chat.decode(reply))
            turn_rewards.append(float(result.reward))
            info = result.info
            if out.finish_reason == "length":
                break
            if result.done:
                status = "completed"
                break
            if turn + 1 == max_turns:
                break
            delta, spans = chat.place_images(chat.delta_ids(result.messages, reply), result.messages)
            if len(log) + len(delta) >= ctx.max_seq_len:
                break
            log.add_env(delta, ctx.engine.policy_version, spans, message_images(result.messages))
    finally:
        await env.close()
    reward = info.get("episode_reward", sum(turn_rewards))
    return log.trajectory(
        id=trajectory_id,
        group_id=group_id,
        env=ctx.env_name,
        reward=float(reward),
        turn_rewards=turn_rewards,
        status=status,
        metadata={"turns": len(finish_reasons), "finish_reasons": finish_reasons, "env_info": _plain(info)},
        created_at=created_at,
        finished_at=time.time(),
    )


def _plain(info: dict[str, Any]) -> dict[str, Any]:
    """Env info reduced to what the wire format can carry (msgspec-encodable builtins)."""
    try:
        return msgspec.to_builtins(info)
    except (TypeError, msgspec.EncodeError):
        return {k: repr(v) for k, v in info.items()}


async def generate(
    ctx: RolloutContext, task: dict[str, Any], trajectory_id: str, group_id: str
) -> Trajectory:
    return await run_episode(ctx, task, trajectory_id, group_id, max_turns=ctx.max_turns)

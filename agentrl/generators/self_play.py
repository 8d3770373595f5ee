"""`self_play`: one game of a multi-seat env, the policy in every seat; one trajectory per seat.

An env with `policy_seats() > 1` offers the multi-seat interface of
`agentrl.envs.textarena_env.TextArenaEnv` (`begin`, `next_turn`, `act`, `seat_rewards`, `game_info`); with one
policy seat (a fixed opponent, or any single-agent env) the game is an ordinary episode and this is
`multi_turn`'s `run_episode`, returned as a list of one.

Per seat the trajectory follows the token-in/token-out rules of `agentrl.generators.multi_turn` exactly: its prompt is
the chat-templated opening that seat was shown, its response holds each of its replies as generated (loss
mask 1, the engine's logprobs and versions) and, between them, the template delta of what it was shown since
(the other seat's move, the board, notices; loss mask 0). A seat's turns never see the other seat's tokens
except as such observations. Trajectory `i` of the returned list is seat `i`, id `<trajectory_id>.p<i>`,
group `<group_id>.p<i>` (the rollout worker groups each seat's trajectories across the task's games, so
GRPO compares a seat with the same seat: see docs/envs.md), reward TextArena's for that seat, and
`metadata.seat`. A seat that never moved (the game ended first) has an empty response: the rollout worker
cannot queue it (see `agentrl.actors.rollout`).

Status: `completed` when the game ended; `truncated` when `ctx.max_turns` moves per seat ran out or a seat's
next turn would pass `max_seq_len` (rewards 0: no result); `aborted` when the engine aborted a reply and
continuing was not possible. A reply cut by `max_new_tokens` is still a move: TextArena judges it.
"""

from __future__ import annotations

import time
from typing import Any

from agentrl.chat import chat_tokens
from agentrl.generator import RolloutContext
from agentrl.generators.multi_turn import _plain, run_episode
from agentrl.turns import TokenLog, generate_turn, turn_sampling
from agentrl.types import Status, Trajectory


async def generate(
    ctx: RolloutContext, task: dict[str, Any], trajectory_id: str, group_id: str
) -> list[Trajectory]:
    env = ctx.make_env()
    seats = env.policy_seats()
    if seats == 1:
        await env.close()
        return [await run_episode(ctx, task, trajectory_id, group_id, max_turns=ctx.max_turns)]
    created_at = time.time()
    try:
        await env.begin(task)
        logs, finish, status = await _play(ctx, env, seats, ctx.request_prefix or trajectory_id)
        rewards = env.seat_rewards() if status == "completed" else dict.fromkeys(range(seats), 0.0)
        info = _plain(env.game_info())
    finally:
        await env.close()
    finished_at = time.time()
    return [
        (logs.get(seat) or TokenLog([])).trajectory(
            id=f"{trajectory_id}.p{seat}",
            group_id=f"{group_id}.p{seat}",
            env=ctx.env_name,
            reward=rewards[seat],
            turn_rewards=[0.0] * (len(finish[seat]) - 1) + [rewards[seat]] if finish[seat] else [],
            status=status,
            metadata={
                "seat": seat,
                "turns": len(finish[seat]),
                "finish_reasons": finish[seat],
                "env_info": info,
            },
            created_at=created_at,
            finished_at=finished_at,
        )
        for seat in range(seats)
    ]


async def _play(
    ctx: RolloutContext, env: Any, seats: int, prefix: str
) -> tuple[dict[int, TokenLog], dict[int, list[str]], Status]:
    """Play the begun game to its end (or a limit): each seat's token log, its turns' finish reasons, and the
    game's status (module docstring)."""
    chat = chat_tokens(ctx.tokenizer)
    sampling = turn_sampling(ctx)
    logs: dict[int, TokenLog] = {}
    replies: dict[int, list[int]] = {}
    finish: dict[int, list[str]] = {seat: [] for seat in range(seats)}
    while True:
        seat, messages = env.next_turn()
        log = logs.get(seat)
        if len(finish[seat]) >= ctx.max_turns:
            return logs, finish, "truncated"
        if log is None:
            log = logs[seat] = TokenLog(chat.prompt_ids(messages))
        else:
            delta = chat.delta_ids(messages, replies[seat])
            if len(log) + len(delta) >= ctx.max_seq_len:
                return logs, finish, "truncated"
            log.add_env(delta, ctx.engine.policy_version)
        if len(log) >= ctx.max_seq_len:
            return logs, finish, "truncated"
        out, reply = await generate_turn(ctx, log, sampling, f"{prefix}.p{seat}.t{len(finish[seat])}")
        if out.finish_reason == "abort":
            if reply:
                finish[seat].append("abort")
            return logs, finish, "aborted"
        finish[seat].append(out.finish_reason)
        replies[seat] = reply
        if await env.act(chat.decode(reply)):
            return logs, finish, "completed"

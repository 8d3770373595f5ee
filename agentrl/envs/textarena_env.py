"""`textarena`: TextArena's two-player games, unchanged, with the policy in one seat or in both (self-play).

`[env] name = "textarena"`, `kwargs = {game = "TicTacToe-v0", opponent = "self" | "random" | "<hf model dir>",
seat = 0}`. The game is TextArena's raw env (`ta.make(game)` unwrapped): agentrl keeps each seat's
conversation itself, token-in/token-out, so TextArena's observation wrappers (which re-send the whole history
as one string every turn) and its action-formatting wrapper are left out; the rules, the judging of moves and
the rewards are TextArena's own (`state.rewards`: +1 / -1 for a win / loss, 0 for a draw; an invalid move gets
one retry, `error_allowance`, then loses the game).

Each seat sees what TextArena sends it: its opening prompt, then per turn the observations addressed to it
since its last move (board, the opponent's move, "invalid move" notices), as one user message with
TextArena's `[GAME]` / `[Player k]` sender tags. Its own moves are its assistant replies.

- `opponent = "self"`: both seats are played by the policy; only the multi-seat interface (`begin`,
  `next_turn`, `act`, `seat_rewards`) applies, driven by `rollout.generator = "self_play"`, which makes one
  trajectory per seat (`policy_seats() == 2`).
- `opponent = "random"`: the other seat plays a random move among the bracketed options of its latest
  observation (TextArena lists them, e.g. `Available Moves: '[0]', '[4]'`), seeded by the task; falls back to
  any bracketed token it was shown.
- `opponent = "<dir>"`: an HF causal LM on CPU (transformers, greedy, `opponent_max_new_tokens`) answers
  the other seat's chat.
With a fixed opponent the env is an ordinary single-agent `AgentEnv` (`reset` / `step`; the opponent's moves
happen inside `step`), so `multi_turn` drives it too. If the opponent loses before the policy's first move
(two invalid moves), the policy's one reply is not played and the step reports TextArena's reward with
`info["policy_moved"] = False`. Games that need the network (TextArena's word games
download NLTK corpora) are not offline; TicTacToe-v0 and TruthAndDeception-v0 are.
"""

from __future__ import annotations

import asyncio
import random
import re
from pathlib import Path
from typing import Any

from agentrl.envs.base import AgentEnv, StepResult
from agentrl.envs.registry import register_env, require_extra
from agentrl.errors import EnvError
from agentrl.types import Message

GAME_ID = -1  # TextArena's sender id for the game itself (ta.GAME_ID)
_BRACKETED = re.compile(r"\[[^\[\]\n]{1,40}\]")
_SENDER = re.compile(r"^\[[^\]\n]*\] ?", re.MULTILINE)


def make_game(game: str) -> Any:
    """TextArena's env for `game`, without its wrappers; an unknown id names the closest registered ones."""
    require_extra(("textarena",), "textarena", "env 'textarena'")
    import textarena as ta
    from textarena.envs.registration import ENV_REGISTRY

    if game not in ENV_REGISTRY:
        import difflib

        near = difflib.get_close_matches(game, list(ENV_REGISTRY), n=3)
        raise EnvError(
            f"env.kwargs.game = '{game}' is not a TextArena game; close: {', '.join(near) or 'none'}"
        )
    env = ta.make(game)
    while isinstance(env, ta.Wrapper):
        env = env.env
    return env


def render(observations: list[tuple[int, str, Any]], player: int, role_mapping: dict[int, str]) -> str:
    """One user message from a seat's new observations; the seat's own moves are its replies, left out."""
    lines = []
    for sender, message, _kind in observations:
        if sender == player:
            continue
        name = "GAME" if sender == GAME_ID else role_mapping.get(sender, f"Player {sender}")
        lines.append(f"[{name}] {message}")
    return "\n".join(lines)


class RandomPlayer:
    """A scripted opponent: a random bracketed option from its newest observation that offers any."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.seen: list[str] = []

    def __call__(self, text: str) -> str:
        self.seen.append(_SENDER.sub("", text))  # the `[GAME]` / `[Player k]` tags are no options
        for past in reversed(self.seen):
            moves = _BRACKETED.findall(past.rsplit("Available Moves:", 1)[-1])
            if moves:
                return self.rng.choice(moves)
        return "[0]"


class HFPlayer:
    """A fixed opponent: an HF causal LM directory run with transformers on CPU, greedy; its chat is tokenized
    by agentrl.chat like the policy's."""

    def __init__(self, path: str, max_new_tokens: int):
        from transformers import AutoModelForCausalLM

        from agentrl.chat import chat_tokens
        from agentrl.tokenizer import load_tokenizer

        self.chat = chat_tokens(load_tokenizer(path))
        self.model = AutoModelForCausalLM.from_pretrained(path).eval()
        self.max_new_tokens = max_new_tokens
        self.history: list[Message] = []

    def __call__(self, text: str) -> str:
        import torch

        self.history.append(Message("user", text))
        ids = torch.tensor([self.chat.prompt_ids(self.history)])
        with torch.no_grad():
            out = self.model.generate(ids, max_new_tokens=self.max_new_tokens, do_sample=False)
        reply = self.chat.decode(out[0, ids.shape[1] :].tolist())
        self.history.append(Message("assistant", reply))
        return reply


@register_env
class TextArenaEnv(AgentEnv):
    name = "textarena"
    description = "TextArena two-player games, self-play or against a fixed opponent"
    max_turns = 9

    def __init__(
        self,
        game: str = "TicTacToe-v0",
        opponent: str = "self",
        seat: int = 0,
        opponent_max_new_tokens: int = 32,
    ):
        super().__init__(
            game=game, opponent=opponent, seat=seat, opponent_max_new_tokens=opponent_max_new_tokens
        )
        if seat not in (0, 1):
            raise EnvError(f"env.kwargs.seat = {seat!r}: the policy's seat is 0 or 1")
        if opponent not in ("self", "random") and not (Path(opponent) / "config.json").exists():
            raise EnvError(
                f"env.kwargs.opponent = '{opponent}': 'self', 'random' or an HF model directory (no config.json there)"
            )
        make_game(game)  # an unknown game or a missing package fails here, when the run is configured
        self.game, self.opponent, self.seat = game, opponent, seat
        self.opponent_max_new_tokens = opponent_max_new_tokens
        self.env: Any = None
        self.player: Any = None
        self.moved = False

    def policy_seats(self) -> int:
        return 2 if self.opponent == "self" else 1

    def sample_tasks(self, seed: int, n: int) -> list[dict[str, Any]]:
        return [{"game": self.game, "seed": seed * 1_000_003 + i} for i in range(n)]

    def demonstration(self, task: dict[str, Any]) -> list[Message]:
        """A game of random legal moves (`RandomPlayer` in both seats) from the view of seat `seed % 2` (with a
        fixed opponent: the policy's seat): it teaches the move format and legality, not strategy."""
        seed = int(task.get("seed", 0))
        seat = seed % 2 if self.opponent == "self" else self.seat
        env = make_game(task.get("game", self.game))
        env.reset(num_players=2, seed=seed)
        players = {0: RandomPlayer(seed), 1: RandomPlayer(seed + 1)}
        messages: list[Message] = []
        while not env.state.done:
            player, observations = env.get_observation()
            text = render(observations, player, env.state.role_mapping)
            move = players[player](text)
            if player == seat:
                messages += [Message("user", text), Message("assistant", move)]
            env.step(move)
        return messages

    # -- the multi-seat interface (self-play generator) ----------------------------------------------------

    async def begin(self, task: dict[str, Any]) -> None:
        """Start a game of `task` (its `seed` fixes TextArena's random setup, e.g. the facts to judge)."""
        self.env = make_game(task.get("game", self.game))
        self.env.reset(num_players=2, seed=int(task.get("seed", 0)))
        if self.opponent == "random":
            self.player = RandomPlayer(int(task.get("seed", 0)))
        elif self.opponent != "self":
            self.player = await asyncio.to_thread(HFPlayer, self.opponent, self.opponent_max_new_tokens)

    @property
    def done(self) -> bool:
        return bool(self.env.state.done)

    def next_turn(self) -> tuple[int, list[Message]]:
        """The seat to move and what it has been shown since its last move (its opening the first time)."""
        player, observations = self.env.get_observation()
        return player, [Message("user", render(observations, player, self.env.state.role_mapping))]

    async def act(self, action: str) -> bool:
        """The seat to move plays `action` (TextArena judges it); returns whether the game is over."""
        done, _info = self.env.step(action)
        return bool(done)

    def seat_rewards(self) -> dict[int, float]:
        """Each seat's reward: TextArena's, or 0 for both while the game is unfinished."""
        rewards = self.env.state.rewards if self.env.state.done else None
        return {seat: float((rewards or {}).get(seat, 0.0)) for seat in (0, 1)}

    def game_info(self) -> dict[str, Any]:
        info = self.env.state.game_info
        return {str(seat): {k: v for k, v in info.get(seat, {}).items() if isinstance(v, str | int | float | bool)}
                for seat in (0, 1)}  # fmt: skip

    # -- single-agent view (fixed opponent) ------------------------------------------------------------------

    async def _opponent_moves(self) -> None:
        while not self.done and self.env.state.current_player_id != self.seat:
            _player, messages = self.next_turn()
            move = await asyncio.to_thread(self.player, messages[0].content)
            await self.act(move)

    def _seat_view(self) -> list[Message]:
        """What the policy's seat has been shown since its last move (read as TextArena's get_observation does)."""
        observations = self.env.state.observations[self.seat]
        self.env.state.observations[self.seat] = []
        return [Message("user", render(observations, self.seat, self.env.state.role_mapping))]

    async def reset(self, task: dict[str, Any]) -> list[Message]:
        if self.opponent == "self":
            raise EnvError(
                "env 'textarena' with opponent = 'self' plays both seats: set rollout.generator = 'self_play'"
            )
        await self.begin(task)
        await self._opponent_moves()
        self.moved = False
        return self._seat_view()

    async def step(self, action: str) -> StepResult:
        if not self.done:  # the opponent may have lost before the policy's first move: then it is not played
            await self.act(action)
            self.moved = True
            await self._opponent_moves()
        if self.done:
            reward = self.seat_rewards()[self.seat]
            info = {"seat": self.seat, "policy_moved": self.moved, "game": self.game_info()}
            return StepResult(reward=reward, done=True, info=info)
        return StepResult(messages=self._seat_view())

    async def close(self) -> None:
        self.player = None

"""A word game written with OpenEnv's server classes, served as OpenEnv serves any env app:
`uvicorn word_game_server:app` (agentrl's `openenv` env starts it on a free port; see docs/envs.md)."""

from openenv.core.env_server import Action, Environment, Observation, State, create_app

WORDS = ["apple", "pear", "plum", "fig"]


class WordAction(Action):
    message: str


class WordObservation(Observation):
    prompt: str = ""


class WordGameEnv(Environment):
    """Say the secret word; a wrong word gets a hint, three words end the game."""

    SUPPORTS_CONCURRENT_SESSIONS = True  # each WebSocket session gets its own instance

    def __init__(self):
        super().__init__()
        self._state, self.secret = State(step_count=0), ""

    def reset(self, seed=None, episode_id=None, **kwargs):
        self._state = State(episode_id=episode_id, step_count=0)
        self.secret = WORDS[(seed or 0) % len(WORDS)]
        return WordObservation(prompt=f"Say the word {self.secret}.")

    def step(self, action, timeout_s=None, **kwargs):
        self._state.step_count += 1
        if action.message.strip() == self.secret:
            return WordObservation(prompt="Correct.", done=True, reward=1.0)
        if self._state.step_count >= 3:
            return WordObservation(prompt="Out of turns.", done=True, reward=0.0)
        return WordObservation(prompt=f"No. Say {self.secret}.", reward=0.0)

    @property
    def state(self):
        return self._state


app = create_app(WordGameEnv, WordAction, WordObservation, env_name="word_game", max_concurrent_envs=64)

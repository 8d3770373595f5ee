"""The generator contract: a rollout program turns one task into one trajectory (or one per seat).

A generator is an async function `generate(ctx: RolloutContext, task: dict, trajectory_id: str,
group_id: str) -> Trajectory`, named in the config as `rollout.generator` ("multi_turn" means
`agentrl.generators.multi_turn:generate`; anything with a colon is `module:function`). Nothing below the
actors imports `agentrl.generators` (import-linter's layers); the name is resolved at run time. The rollout worker runs n generators per task
with one `group_id`. For a multi-agent env (`env.policy_seats() > 1`, e.g. `self_play`) it returns a list,
one trajectory per seat, seat i's id `<trajectory_id>.p<i>` in group `<group_id>.p<i>`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from agentrl.engines.base import Engine, SamplingParams
from agentrl.envs.base import AgentEnv
from agentrl.errors import ConfigError
from agentrl.plugins import load_object
from agentrl.types import Trajectory


@dataclass
class RolloutContext:
    """What a generator is given for one episode. The rollout worker fills every field from the config
    (`RolloutWorker._context`); a field's comment names the config field it comes from."""

    engine: Engine
    tokenizer: Any  # a Hugging Face tokenizer with a chat template
    make_env: Callable[[], AgentEnv]
    env_name: str
    sampling: SamplingParams
    max_turns: int = 4  # rollout.max_turns
    max_seq_len: int = 1024  # engine.max_seq_len
    # engine request ids start with this; new for every attempt of an episode ("": the trajectory id)
    request_prefix: str = ""
    abort_retries: int = 3  # rollout.abort_retries: continuations of a reply cut by a weight update
    tool_parser: str = (
        ""  # rollout.tool_parser: the proxy's reply -> tool_calls parser ("": by chat template)
    )
    agent: str = ""  # rollout.agent: the openai_proxy generator's 'module:function' agent ("": the default)
    proxy_sampling: str = "refuse"  # rollout.proxy_sampling
    proxy_host: str = "127.0.0.1"  # rollout.proxy_host
    proxy_token: str = ""  # rollout.proxy_token
    proxy_keep_side_requests: bool = False  # rollout.proxy_keep_side_requests
    external_timeout_s: float = 300.0  # rollout.external_timeout_s
    # where the HTTP-serving generators record their URLs (runs/NAME/proxy.json); "": nowhere
    run_dir: str = ""
    worker_id: int = 0  # names this worker's entries in proxy.json
    # where an episode's trajectories beyond the one it returns go (earlier segments, other agents); None:
    # dropped and counted. The rollout worker passes none: an episode is one trajectory of its group.
    sink: Callable[[list[Trajectory]], Any] | None = None


# name -> 'module:function' in the `agentrl.generators` package
BUILTIN_GENERATORS = {
    "multi_turn": "agentrl.generators.multi_turn:generate",
    "single_turn": "agentrl.generators.single_turn:generate",
    "openai_proxy": "agentrl.generators.proxy_agent:generate",
    "external": "agentrl.generators.external:generate",
    "self_play": "agentrl.generators.self_play:generate",
}
GeneratorFn = Callable[[RolloutContext, dict[str, Any], str, str], Awaitable[Trajectory | list[Trajectory]]]


def resolve_generator(name: str) -> GeneratorFn:
    """'multi_turn' -> agentrl.generators.multi_turn:generate; 'pkg.mod:fn' -> that function (agentrl.plugins)."""
    if ":" in name:
        return load_object(name, "rollout.generator")
    if name not in BUILTIN_GENERATORS:
        raise ConfigError(
            f"rollout.generator = '{name}': not a built-in generator ({', '.join(BUILTIN_GENERATORS)}); "
            "for your own, use 'module:function'"
        )
    return load_object(BUILTIN_GENERATORS[name], "rollout.generator")

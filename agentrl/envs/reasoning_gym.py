"""`reasoning_gym`: reasoning-gym's procedural tasks, unchanged, as a single-turn env (`agentrl[reasoning-gym]`).

`[env] name = "reasoning_gym"`, `kwargs = {dataset = "basic_arithmetic", config = {...}}`, or
`dataset = "composite"` with `datasets = [{name = "chain_sum", weight = 2, config = {...}}, ...]` (reasoning-gym's
own `DatasetSpec`s). Tasks are entries its generators make (`question`, `answer`, `metadata`) and the reward is
its own scorer, `dataset.score_answer(extracted, entry)` (partial credit where a dataset gives it).

Seeding: batch `s` of `sample_tasks(s, n)` is entries 0..n-1 of the dataset created with seed
`seed + s * STRIDE` (mod 2**32, as some generators seed numpy), and reasoning-gym derives entry i from
`seed + i`; so batches are a pure function of `s` (a resumed run, whose cursor counts batches, continues with
the very tasks an uninterrupted run would have drawn) and 2**20 consecutive batches never share an entry.
With `size > 0` the tasks come from one fixed pool of `size` entries instead (batch s starts at s * n).

Pictures pass through: an entry with `images` (a list of pictures, the key Hugging Face vision datasets use:
image files, base64 strings, Pillow images or pixel arrays; agentrl/envs/pictures.py) is asked as one user
message holding those pictures before the question, for a vision-language model. The task and the entry the
scorer sees carry them as image files.

Answer extraction: the last `<answer>...</answer>` (reasoning-gym's `extract_answer`, the format its system
prompts ask for); with `fallback` (default) a reply without tags is scored as a whole, stripped.
"""

from __future__ import annotations

import difflib
import functools
import json
from typing import Any

import reasoning_gym
from reasoning_gym.factory import DATASETS
from reasoning_gym.utils import SYSTEM_PROMPTS, extract_answer

from agentrl.envs.base import AgentEnv, StepResult
from agentrl.envs.pictures import content, image_file
from agentrl.envs.registry import register_env
from agentrl.errors import EnvError
from agentrl.types import Message

STRIDE = 4096  # seeds of consecutive batches lie this far apart: room for n tasks and a composite's datasets
SEED_MOD = 2**32 - STRIDE  # pool_matrix calls np.random.seed(seed + idx), which needs a value below 2**32


def dataset_names() -> list[str]:
    """What `agentrl envs` shows as provided: every dataset reasoning-gym registers (plus 'composite')."""
    return sorted(DATASETS)


def _check_name(name: Any, key: str) -> str:
    if name not in DATASETS:
        hint = difflib.get_close_matches(str(name), DATASETS, n=1)
        near = f"; did you mean '{hint[0]}'?" if hint else ""
        raise EnvError(
            f"{key} = {name!r} is not a reasoning-gym dataset{near} (`agentrl envs -v` lists them)"
        )
    return name


@functools.lru_cache(maxsize=16)
def _create(spec_json: str, seed: int, size: int) -> Any:
    """reasoning-gym's dataset for a spec (cached: creating one may load word lists); errors name the key."""
    spec = json.loads(spec_json)
    try:
        if spec["dataset"] == "composite":
            from reasoning_gym.composite import DatasetSpec

            specs = [
                DatasetSpec(d["name"], float(d.get("weight", 1.0)), dict(d.get("config", {})))
                for d in spec["datasets"]
            ]
            return reasoning_gym.create_dataset("composite", datasets=specs, seed=seed, size=size)
        return reasoning_gym.create_dataset(spec["dataset"], **spec["config"], seed=seed, size=size)
    except (TypeError, ValueError, AssertionError, KeyError) as exc:
        key = "env.kwargs.datasets" if spec["dataset"] == "composite" else "env.kwargs.config"
        raise EnvError(f"{key} for reasoning-gym dataset '{spec['dataset']}': {exc!r}") from None


@register_env
class ReasoningGymEnv(AgentEnv):
    name = "reasoning_gym"
    description = (
        "single-turn: reasoning-gym's procedural tasks (any dataset or a weighted composite), its scorer"
    )
    max_turns = 1

    def __init__(
        self,
        dataset: str = "basic_arithmetic",
        config: dict[str, Any] | None = None,
        datasets: list[dict[str, Any]] | None = None,
        seed: int = 0,
        size: int = 0,
        system_prompt: str = "default",
        fallback: bool = True,
    ):
        super().__init__(
            dataset=dataset, config=config, datasets=datasets, seed=seed, size=size,
            system_prompt=system_prompt, fallback=fallback,
        )  # fmt: skip
        self.spec = json.dumps(self._spec(dataset, config or {}, datasets or []), sort_keys=True)
        if not isinstance(seed, int) or not isinstance(size, int) or size < 0:
            raise EnvError(
                f"env.kwargs.seed and env.kwargs.size must be integers (size >= 0), got {seed!r}, {size!r}"
            )
        self.seed, self.size, self.fallback = seed, size, fallback
        self.system_prompt = SYSTEM_PROMPTS.get(system_prompt, system_prompt)
        self.scorer = _create(self.spec, seed % SEED_MOD, size or 1)  # fails here on a bad config
        self.task: dict[str, Any] = {}

    @staticmethod
    def _spec(dataset: str, config: dict[str, Any], datasets: list[dict[str, Any]]) -> dict[str, Any]:
        if dataset != "composite":
            if datasets:
                raise EnvError("env.kwargs.datasets is for dataset = 'composite'; use env.kwargs.config")
            return {"dataset": _check_name(dataset, "env.kwargs.dataset"), "config": config}
        if not datasets or config:
            raise EnvError(
                "env.kwargs: dataset = 'composite' takes datasets = [{name, weight, config}, ...] and no config"
            )
        for i, spec in enumerate(datasets):
            if not isinstance(spec, dict) or set(spec) - {"name", "weight", "config"}:
                raise EnvError(
                    f"env.kwargs.datasets[{i}] must be a table of name, weight and config, got {spec!r}"
                )
            _check_name(spec.get("name"), f"env.kwargs.datasets[{i}].name")
        return {"dataset": "composite", "datasets": datasets}

    def sample_tasks(self, seed: int, n: int) -> list[dict[str, Any]]:
        if self.size:  # one fixed pool: batch `seed` continues where the previous one ended
            return [self._task(self.scorer[(seed * n + i) % self.size]) for i in range(n)]
        if n > STRIDE // 2:
            raise EnvError(f"reasoning_gym: at most {STRIDE // 2} tasks per batch, asked for {n}")
        dataset = _create(self.spec, (self.seed + seed * STRIDE) % SEED_MOD, n)
        return [self._task(dataset[i]) for i in range(n)]

    @staticmethod
    def _task(entry: dict[str, Any]) -> dict[str, Any]:
        if entry.get("images"):  # as files: a task crosses processes and is logged
            files = [image_file(p, f"reasoning-gym entry images[{i}]") for i, p in enumerate(entry["images"])]
            entry = {**entry, "images": files}
        return {"question": entry["question"], "answer": entry["answer"], "entry": entry}

    def _opening(self, task: dict[str, Any]) -> list[Message]:
        system = [Message("system", self.system_prompt)] if self.system_prompt else []
        return [*system, Message("user", content(task["question"], task["entry"].get("images") or []))]

    def demonstration(self, task: dict[str, Any]) -> list[Message]:
        if task["answer"] is None:
            raise NotImplementedError(
                f"reasoning-gym task has no reference answer: {task['question'][:80]!r}"
            )
        return [*self._opening(task), Message("assistant", f"<answer>{task['answer']}</answer>")]

    def extract(self, reply: str) -> str | None:
        """The answer the reply gives: the last <answer> tag, else (with `fallback`) the reply stripped."""
        answer = extract_answer(reply)
        if answer is None and self.fallback:
            answer = reply.strip()
        return answer

    async def reset(self, task: dict[str, Any]) -> list[Message]:
        self.task = task
        return self._opening(task)

    async def step(self, action: str) -> StepResult:
        answer = self.extract(action)
        reward = float(self.scorer.score_answer(answer, self.task["entry"]))
        return StepResult(reward=reward, done=True, info={"answer": answer, "reference": self.task["answer"]})

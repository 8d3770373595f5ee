"""Prompt datasets (JSONL or Parquet) and task sources with a resumable cursor.

A task is a plain dict: `prompt` (a string, or a list of {role, content} messages), `answer` (the label, when
`label_key` is set), `metadata` (a dict, when `metadata_key` is set), `apply_chat_template` (bool), and
`data_index` / `data_epoch` (where it came from). Envs read it in `reset`.

Invariants: rows are validated when the file is loaded, and a malformed row raises `DataError` naming the
file, the line (1-based; for Parquet the row number) and the key; the order of epoch e is a permutation
seeded by (seed, e), so it is the same on every run and after a resume; `state_dict()` captures the cursor
(epoch, position) exactly, so a checkpointed run continues with the next unseen task, none repeated or
skipped. Imports nothing heavy (pyarrow only for .parquet files).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import msgspec

from agentrl.errors import DataError


def _check_prompt(value: Any, where: str, key: str) -> Any:
    if isinstance(value, str):
        if not value:
            raise DataError(f"{where}: key '{key}' is an empty string")
        return value
    if isinstance(value, list) and value:
        for i, msg in enumerate(value):
            ok = (
                isinstance(msg, dict)
                and isinstance(msg.get("role"), str)
                and isinstance(msg.get("content"), str)
            )
            if not ok:
                raise DataError(
                    f"{where}: key '{key}'[{i}] must be a {{role, content}} message with string fields"
                )
        return [{"role": m["role"], "content": m["content"]} for m in value]
    raise DataError(
        f"{where}: key '{key}' must be a non-empty string or list of messages, got {type(value).__name__}"
    )


def _read_rows(path: Path) -> list[tuple[str, Any]]:
    """(location, row) pairs; location is 'file:line' for JSONL and 'file:row N' for Parquet."""
    if not path.exists():
        raise DataError(f"data.path: file not found: {path}")
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError(
                f"{path}: reading Parquet needs pyarrow (pip install 'agentrl[parquet]')"
            ) from None
        rows = pq.read_table(path).to_pylist()
        return [(f"{path}:row {i + 1}", row) for i, row in enumerate(rows)]
    if path.suffix not in (".jsonl", ".json"):
        raise DataError(f"data.path: {path} must be .jsonl or .parquet")
    out = []
    with path.open("rb") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                out.append((f"{path}:{lineno}", msgspec.json.decode(line)))
            except msgspec.DecodeError as exc:
                raise DataError(f"{path}:{lineno}: invalid JSON ({exc})") from None
    return out


class PromptDataset:
    """Rows of a JSONL/Parquet file served as tasks, in seeded shuffled order, for `epochs` passes."""

    def __init__(
        self,
        path: str | Path,
        input_key: str = "prompt",
        label_key: str = "answer",
        metadata_key: str = "",
        apply_chat_template: bool = True,
        shuffle: bool = True,
        seed: int = 0,
        epochs: int = 1,
    ):
        if epochs < 1:
            raise DataError(f"data.epochs must be >= 1, got {epochs}")
        self.path, self.shuffle, self.seed, self.epochs = Path(path), shuffle, seed, epochs
        self.apply_chat_template = apply_chat_template
        self.rows = [
            self._parse(where, row, input_key, label_key, metadata_key)
            for where, row in _read_rows(self.path)
        ]
        if not self.rows:
            raise DataError(f"data.path: {self.path} holds no rows")
        self.epoch = self.position = 0
        self._order = self._permutation(0)

    @classmethod
    def from_config(
        cls,
        data: Any,
        path: str = "",
        shuffle: bool | None = None,
        epochs: int | None = None,
        seed: int | None = None,
    ) -> PromptDataset:
        """From a `DataSection`; `path`, `shuffle`, `epochs` and `seed` override it (eval set, warm-up)."""
        return cls(
            path or data.path,
            input_key=data.input_key,
            label_key=data.label_key,
            metadata_key=data.metadata_key,
            apply_chat_template=data.apply_chat_template,
            shuffle=data.shuffle if shuffle is None else shuffle,
            seed=data.seed if seed is None else seed,
            epochs=data.epochs if epochs is None else epochs,
        )

    @staticmethod
    def _parse(where: str, row: Any, input_key: str, label_key: str, metadata_key: str) -> dict[str, Any]:
        if not isinstance(row, dict):
            raise DataError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
        if input_key not in row:
            raise DataError(f"{where}: missing key '{input_key}' (data.input_key)")
        task: dict[str, Any] = {"prompt": _check_prompt(row[input_key], where, input_key)}
        if label_key:
            if row.get(label_key) is None:
                raise DataError(
                    f"{where}: missing key '{label_key}' (data.label_key; set it to \"\" for no label)"
                )
            task["answer"] = row[label_key]
        if metadata_key:
            meta = row.get(metadata_key, {})
            if not isinstance(meta, dict):
                raise DataError(f"{where}: key '{metadata_key}' (data.metadata_key) must be an object")
            task["metadata"] = meta
        return task

    def __len__(self) -> int:
        return len(self.rows)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    @property
    def exhausted(self) -> bool:
        return self.epoch >= self.epochs

    def next_batch(self, n: int) -> list[dict[str, Any]]:
        """Up to n tasks (fewer only when the last epoch ends); [] once exhausted."""
        out = []
        while len(out) < n and not self.exhausted:
            index = self._order[self.position]
            out.append(
                {
                    **self.rows[index],
                    "apply_chat_template": self.apply_chat_template,
                    "data_index": index,
                    "data_epoch": self.epoch,
                }
            )
            self.position += 1
            if self.position == len(self.rows):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
        return out

    def __iter__(self):
        while batch := self.next_batch(1):
            yield batch[0]

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": "dataset",
            "epoch": self.epoch,
            "position": self.position,
            "num_rows": len(self.rows),
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (
            state.get("kind") != "dataset"
            or state.get("num_rows") != len(self.rows)
            or state.get("seed") != self.seed
        ):
            raise DataError(
                f"data cursor does not match {self.path} ({len(self.rows)} rows, seed {self.seed}): {state}; "
                "the dataset or data.seed changed since the checkpoint"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation(self.epoch)


class EnvTaskSource:
    """Tasks an env generates itself (`sample_tasks`): batch k is `sample_tasks(seed=f(seed, k), n)`.
    Endless; the cursor is the number of batches drawn."""

    exhausted = False

    def __init__(self, env: Any, seed: int = 0):
        self.env, self.seed, self.batches = env, seed, 0

    def next_batch(self, n: int) -> list[dict[str, Any]]:
        tasks = self.env.sample_tasks(self.seed * 1_000_003 + self.batches, n)
        self.batches += 1
        return tasks

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "env", "batches": self.batches, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != "env" or state.get("seed") != self.seed:
            raise DataError(
                f"data cursor {state} does not belong to env-generated tasks with seed {self.seed}"
            )
        self.batches = int(state["batches"])


class _WarmupEnvTasks:
    """Batch k of the warm-up is `env.sample_tasks(seed + k, n)`."""

    def __init__(self, env: Any, seed: int):
        self.env, self.seed, self.batches = env, seed, 0

    def next_batch(self, n: int) -> list[dict[str, Any]]:
        tasks = self.env.sample_tasks(self.seed + self.batches, n)
        self.batches += 1
        return tasks


def warmup_source(env: Any, data: Any, seed: int) -> PromptDataset | _WarmupEnvTasks:
    """Tasks for the supervised warm-up (`warmup.seed`): with `data.path`, the dataset's rows in an order
    seeded by `seed`, cycling as long as the warm-up lasts (dataset envs such as `math` generate no tasks);
    else the env's own tasks."""
    if data.path:
        return PromptDataset.from_config(data, seed=seed, epochs=sys.maxsize)
    return _WarmupEnvTasks(env, seed)


EVAL_SEED_OFFSET = 10**9


def task_source(env: Any, data: Any, seed: int = 0) -> PromptDataset | EnvTaskSource:
    """Training tasks: the dataset at `data.path` when set, else the env's own `sample_tasks`."""
    if data.path:
        return PromptDataset.from_config(data)
    return EnvTaskSource(env, seed=seed + data.seed)


def eval_tasks(env: Any, data: Any, n: int) -> list[dict[str, Any]]:
    """Held-out tasks: the first n rows of `data.eval_path` (unshuffled), else env tasks from a seed range
    disjoint from training's."""
    if data.eval_path:
        return PromptDataset.from_config(data, path=data.eval_path, shuffle=False, epochs=1).next_batch(n)
    return env.sample_tasks(EVAL_SEED_OFFSET + data.seed, n)

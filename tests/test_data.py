"""Prompt datasets: JSONL and Parquet loading, malformed rows named by file/line/key, seeded shuffling,
epochs, the resumable cursor, env-generated task sources, and the `math` env fed by a dataset."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from agentrl.config.rollout import DataSection
from agentrl.data import EnvTaskSource, PromptDataset, eval_tasks, task_source
from agentrl.envs import make_env
from agentrl.errors import DataError

ROWS = [{"question": f"What is {i}+{i}?", "solution": str(2 * i), "meta": {"i": i}} for i in range(10)]


def write_jsonl(path, rows, raw_lines=()):
    lines = [json.dumps(r) for r in rows] + list(raw_lines)
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def jsonl(tmp_path):
    return write_jsonl(tmp_path / "train.jsonl", ROWS)


def ds(path, **kw):
    kw = {"input_key": "question", "label_key": "solution", "metadata_key": "meta", **kw}
    return PromptDataset(path, **kw)


def test_jsonl_rows_become_tasks(jsonl):
    data = ds(jsonl, shuffle=False)
    assert len(data) == 10
    task = data.next_batch(1)[0]
    assert task == {
        "prompt": "What is 0+0?",
        "answer": "0",
        "metadata": {"i": 0},
        "apply_chat_template": True,
        "data_index": 0,
        "data_epoch": 0,
    }


def test_parquet_matches_jsonl(tmp_path, jsonl):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    assert [t["prompt"] for t in ds(path, seed=3)] == [t["prompt"] for t in ds(jsonl, seed=3)]


def test_chat_prompts_and_template_flag(tmp_path):
    rows = [
        {
            "prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
            "answer": 1,
        }
    ]
    data = PromptDataset(write_jsonl(tmp_path / "c.jsonl", rows), apply_chat_template=False)
    task = data.next_batch(5)[0]
    assert task["prompt"][1] == {"role": "user", "content": "hi"} and task["apply_chat_template"] is False


@pytest.mark.parametrize(
    "rows,raw,match",
    [
        (ROWS[:2], ["{not json"], r"train\.jsonl:3: invalid JSON"),
        ([*ROWS[:3], {"solution": "1"}], [], r"train\.jsonl:4: missing key 'question' \(data.input_key\)"),
        ([ROWS[0], {"question": "q"}], [], r"train\.jsonl:2: missing key 'solution' \(data.label_key"),
        ([{"question": 5, "solution": "1"}], [], r"train\.jsonl:1: key 'question' must be"),
        ([{"question": "", "solution": "1"}], [], r"train\.jsonl:1: key 'question' is an empty string"),
        ([{"question": [{"role": "user"}], "solution": "1"}], [], r"train\.jsonl:1: key 'question'\[0\]"),
        (
            [{"question": "q", "solution": "1", "meta": [1]}],
            [],
            r"train\.jsonl:1: key 'meta' \(data.metadata_key\)",
        ),
        ([], ["[1, 2]"], r"train\.jsonl:1: a row must be a JSON object"),
    ],
)
def test_malformed_rows_named(tmp_path, rows, raw, match):
    path = write_jsonl(tmp_path / "train.jsonl", rows, raw)
    with pytest.raises(DataError, match=match):
        ds(path)


def test_malformed_parquet_row_named(tmp_path):
    path = tmp_path / "bad.parquet"
    pq.write_table(
        pa.Table.from_pylist([{"question": "q", "solution": "1"}, {"question": "q", "solution": None}]), path
    )
    with pytest.raises(DataError, match=r"bad\.parquet:row 2: missing key 'solution'"):
        ds(path, metadata_key="")


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(DataError, match="file not found"):
        ds(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match="no rows"):
        ds(tmp_path / "empty.jsonl")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match=r"\.jsonl or \.parquet"):
        ds(tmp_path / "x.csv")


def test_seeded_shuffle_and_epochs(jsonl):
    order = lambda d: [t["data_index"] for t in d]  # noqa: E731
    a, b, c = (
        order(ds(jsonl, seed=1, epochs=2)),
        order(ds(jsonl, seed=1, epochs=2)),
        order(ds(jsonl, seed=2, epochs=2)),
    )
    assert a == b and a != c and len(a) == 20
    assert sorted(a[:10]) == list(range(10)) and sorted(a[10:]) == list(range(10))
    assert a[:10] != a[10:]  # each epoch reshuffles
    assert order(ds(jsonl, shuffle=False)) == list(range(10))


def test_next_batch_crosses_epochs_then_stops(jsonl):
    data = ds(jsonl, epochs=2)
    sizes = [len(data.next_batch(4)) for _ in range(6)]
    assert sizes == [4, 4, 4, 4, 4, 0] and data.exhausted


def test_cursor_resume_continues_exactly(jsonl):
    full = [t["data_index"] for t in ds(jsonl, seed=5, epochs=3)]
    data = ds(jsonl, seed=5, epochs=3)
    head = [t["data_index"] for t in data.next_batch(13)]
    state = json.loads(json.dumps(data.state_dict()))  # survives a checkpoint file
    resumed = ds(jsonl, seed=5, epochs=3)
    resumed.load_state_dict(state)
    assert head + [t["data_index"] for t in resumed] == full
    with pytest.raises(DataError, match=r"data.seed changed"):
        ds(jsonl, seed=6).load_state_dict(state)


def test_env_task_source_resumes():
    env = make_env("arithmetic")
    src = EnvTaskSource(env, seed=1)
    first, second = src.next_batch(4), src.next_batch(4)
    assert first != second
    again = EnvTaskSource(env, seed=1)
    again.load_state_dict(json.loads(json.dumps({**src.state_dict(), "batches": 1})))
    assert again.next_batch(4) == second
    with pytest.raises(DataError):
        again.load_state_dict({"kind": "dataset"})


def test_task_source_from_config(jsonl, tmp_path):
    env = make_env("math")
    cfg = DataSection(path=str(jsonl), input_key="question", label_key="solution", eval_path=str(jsonl))
    assert isinstance(task_source(env, cfg), PromptDataset)
    assert [t["data_index"] for t in eval_tasks(env, cfg, 3)] == [0, 1, 2]
    arith = make_env("arithmetic")
    assert isinstance(task_source(arith, DataSection()), EnvTaskSource)
    held_out = eval_tasks(arith, DataSection(), 8)
    assert held_out == eval_tasks(arith, DataSection(), 8) and held_out != task_source(
        arith, DataSection()
    ).next_batch(8)


async def test_math_env_scores_dataset_tasks(jsonl):
    env = make_env("math")
    for task in ds(jsonl, epochs=1):
        await env.reset(task)
        assert (await env.step(f"it is \\boxed{{{task['answer']}}}")).reward == 1.0
        await env.reset(task)
        assert (await env.step("\\boxed{-1}")).reward == 0.0

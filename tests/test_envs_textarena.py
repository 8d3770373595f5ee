"""TextArena under agentrl, against the real textarena package and a tiny real model: self-play gives one
trajectory per seat, token-exact and with TextArena's zero-sum rewards; a random opponent; an illegal move
ends the game as TextArena says; the rollout worker groups each seat's trajectories and queues only complete
groups; an `agentrl run` of self-play keeps its ledger consistent."""

from __future__ import annotations

import asyncio

import pytest

from agentrl.chat import chat_tokens
from agentrl.engines.base import SamplingParams
from agentrl.envs import env_factory, make_env
from agentrl.generator import RolloutContext, resolve_generator
from agentrl.types import floats, mask, n_response, tokens
from tests.gen_support import HFEngine, real_model_logprob
from tests.run_support import Handle

pytest.importorskip("textarena")


def context(engine, tok, max_turns=6, max_seq_len=2048, max_new_tokens=8, **env_kwargs):
    kwargs = {"game": "TicTacToe-v0", "opponent": "self", **env_kwargs}
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, seed=0)
    return RolloutContext(engine=engine, tokenizer=tok, make_env=env_factory("textarena", kwargs),
                          env_name="textarena", sampling=params, max_turns=max_turns,
                          max_seq_len=max_seq_len)  # fmt: skip


def seat_script(tok, moves: dict[int, list[str]]):
    """Force each seat's replies: the seat is read from its own prompt ("You are Player k")."""
    chat = chat_tokens(tok)
    left = {seat: iter(replies) for seat, replies in moves.items()}

    def script(input_ids: list[int]) -> list[int]:
        seat = 0 if "You are Player 0" in tok.decode(input_ids) else 1
        return [*tok.encode(next(left[seat]), add_special_tokens=False), chat.eot_id]

    return script


async def replay_seats(tok, moves: list[tuple[int, str]], task):
    """Play `moves` (seat, text) on a fresh game and build each seat's expected token record: the prompt,
    then per move the reply tokens (mask 1) and the template delta of what the seat was shown next (mask 0)."""
    chat = chat_tokens(tok)
    env = make_env("textarena", {"game": "TicTacToe-v0", "opponent": "self"})
    await env.begin(task)
    expected: dict[int, tuple[list[int], list[int], list[int]]] = {}
    last: dict[int, list[int]] = {}
    for seat, text in moves:
        player, messages = env.next_turn()
        assert player == seat
        if seat not in expected:
            expected[seat] = (chat.prompt_ids(messages), [], [])
        else:
            delta = chat.delta_ids(messages, last[seat])
            expected[seat][1].extend(delta)
            expected[seat][2].extend([0] * len(delta))
        reply = [*tok.encode(text, add_special_tokens=False), chat.eot_id]
        expected[seat][1].extend(reply)
        expected[seat][2].extend([1] * len(reply))
        last[seat] = reply
        await env.act(text)
    return expected, env.seat_rewards()


def test_self_play_gives_one_token_exact_trajectory_per_seat_with_zero_sum_rewards(tiny, tok):
    moves = {0: ["[0]", "[1]", "[2]"], 1: ["[4]", "[8]"]}  # seat 0 takes the top row
    engine = HFEngine(tiny, version=3, script=seat_script(tok, moves))
    task = {"game": "TicTacToe-v0", "seed": 7}
    trajs = asyncio.run(resolve_generator("self_play")(context(engine, tok), task, "t0-s0", "t0"))
    assert [t.id for t in trajs] == ["t0-s0.p0", "t0-s0.p1"]
    assert [t.group_id for t in trajs] == ["t0.p0", "t0.p1"]
    assert [t.status for t in trajs] == ["completed", "completed"]
    assert [t.reward for t in trajs] == [1.0, -1.0] and sum(t.reward for t in trajs) == 0
    assert [t.metadata["seat"] for t in trajs] == [0, 1] and [t.metadata["turns"] for t in trajs] == [3, 2]
    order = [(0, "[0]"), (1, "[4]"), (0, "[1]"), (1, "[8]"), (0, "[2]")]
    expected, rewards = asyncio.run(replay_seats(tok, order, task))
    assert rewards == {0: 1.0, 1: -1.0}
    for seat, traj in enumerate(trajs):
        prompt, response, loss_mask = expected[seat]
        assert tokens(traj.prompt_ids).tolist() == prompt
        assert tokens(traj.response_ids).tolist() == response
        assert mask(traj).tolist() == loss_mask
        lp = floats(traj.logprobs)
        assert all(lp[i] == 0.0 for i, m in enumerate(loss_mask) if m == 0)
        first = prompt + response[:1]  # the seat's first reply token: the model's own logprob
        assert lp[0] == pytest.approx(real_model_logprob(tiny, prompt, first[-1]), abs=1e-4)
    # token-in/token-out: every engine call saw exactly its seat's record so far, never the other seat's
    records = {
        seat: tokens(t.prompt_ids).tolist() + tokens(t.response_ids).tolist() for seat, t in enumerate(trajs)
    }
    for call in engine.calls:
        seat = 0 if "You are Player 0" in tok.decode(call) else 1
        assert records[seat][: len(call)] == call


def test_self_play_of_a_conversation_game_truth_and_deception(tiny, tok):
    engine = HFEngine(
        tiny, script=seat_script(tok, {0: ["Trust me."] * 3, 1: ["Really?"] * 3 + ["[Fact 2]"]})
    )
    ctx = context(engine, tok, max_new_tokens=16, game="TruthAndDeception-v0")
    task = {"game": "TruthAndDeception-v0", "seed": 2}
    trajs = asyncio.run(resolve_generator("self_play")(ctx, task, "t5-s0", "t5"))
    assert [t.status for t in trajs] == ["completed", "completed"]
    assert [t.metadata["turns"] for t in trajs] == [3, 4] and sum(t.reward for t in trajs) == 0
    guesser = tok.decode(tokens(trajs[1].prompt_ids).tolist() + tokens(trajs[1].response_ids).tolist())
    assert "you are the Guesser" in guesser and "[Deceiver] Trust me." in guesser
    assert "Fact 2: A group of crows is called a murder." in guesser  # the task's seed picks the facts
    assert [t.reward for t in trajs] == [-1.0, 1.0]  # the guesser named the true fact: the deceiver lost


def test_random_opponent_plays_legal_moves_and_the_reward_is_textarenas(tiny, tok):
    chat = chat_tokens(tok)

    def first_free(input_ids):  # the policy (seat 1) plays the first available cell
        shown = tok.decode(input_ids).rsplit("Available Moves:", 1)[-1]
        cell = shown.split("'")[1]
        return [*tok.encode(cell, add_special_tokens=False), chat.eot_id]

    engine = HFEngine(tiny, script=first_free)
    ctx = context(engine, tok, max_turns=9, opponent="random", seat=1)
    task = {"game": "TicTacToe-v0", "seed": 3}
    (traj,) = asyncio.run(resolve_generator("self_play")(ctx, task, "t1-s0", "t1"))
    assert traj.id == "t1-s0" and traj.group_id == "t1" and traj.status == "completed"
    info = traj.metadata["env_info"]["game"]
    assert not info["0"]["invalid_move"] and not info["1"]["invalid_move"]
    assert traj.reward in (-1.0, 0.0, 1.0)
    # the same seed and the same policy moves replay the same game: the reward is TextArena's outcome
    again = asyncio.run(resolve_generator("multi_turn")(context(HFEngine(tiny, script=first_free), tok,
                        max_turns=9, opponent="random", seat=1), task, "t1-s0", "t1"))  # fmt: skip
    assert (
        again.reward == traj.reward
        and tokens(again.response_ids).tolist() == tokens(traj.response_ids).tolist()
    )
    assert "You are Player 1" in tok.decode(tokens(traj.prompt_ids).tolist())


def test_an_illegal_move_gets_one_retry_then_loses_as_textarena_says(tiny, tok):
    # seat 0: a bad format (retry notice), then an occupied cell... no: first move legal, then two bad ones
    moves = {0: ["[4]", "nonsense", "[4]"], 1: ["[0]"]}
    engine = HFEngine(tiny, script=seat_script(tok, moves))
    trajs = asyncio.run(resolve_generator("self_play")(context(engine, tok), {"seed": 1}, "t2-s0", "t2"))
    assert [t.reward for t in trajs] == [-1.0, 1.0] and trajs[0].metadata["turns"] == 3
    info = trajs[0].metadata["env_info"]
    assert info["0"]["invalid_move"] and "already occupied" in info["0"]["reason"]
    text = tok.decode(tokens(trajs[0].response_ids).tolist())
    assert "attempted an invalid move" in text and "does not follow the correct format" in text
    # seat 0 fails twice at once: the game is over before seat 1 moves, so seat 1 has no tokens
    engine = HFEngine(tiny, script=seat_script(tok, {0: ["x", "y"], 1: []}))
    trajs = asyncio.run(resolve_generator("self_play")(context(engine, tok), {"seed": 1}, "t3-s0", "t3"))
    assert [t.reward for t in trajs] == [-1.0, 1.0] and [n_response(t) > 0 for t in trajs] == [True, False]
    assert trajs[1].status == "completed" and trajs[1].metadata["turns"] == 0


def test_multi_turn_with_self_play_env_names_the_generator(tok):
    env = make_env("textarena", {"opponent": "self"})
    from agentrl.errors import EnvError

    with pytest.raises(EnvError, match=r"rollout\.generator = 'self_play'"):
        asyncio.run(env.reset({"seed": 0}))
    with pytest.raises(EnvError, match="TicTacToe-v0"):
        make_env("textarena", {"game": "TicTacToe-v9"})
    with pytest.raises(EnvError, match="opponent"):
        make_env("textarena", {"opponent": "/no/such/model"})


def test_demonstrations_play_legal_moves_in_the_seats_view():
    env = make_env("textarena", {"game": "TicTacToe-v0", "opponent": "self"})
    for seed in (4, 5):
        messages = env.demonstration({"seed": seed})
        assert [m.role for m in messages] == ["user", "assistant"] * (len(messages) // 2)
        assert f"You are Player {seed % 2}" in messages[0].content
        for shown, move in zip(messages[::2], messages[1::2], strict=True):
            assert f"'{move.content}'" in shown.content.rsplit("Available Moves:", 1)[1]


def test_hf_model_opponent(tiny, tok):
    engine = HFEngine(tiny, script=seat_script(tok, {1: ["[0]", "[1]", "[2]", "[3]", "[5]"]}))
    ctx = context(engine, tok, max_turns=5, opponent=str(tiny), seat=1, opponent_max_new_tokens=4)
    (traj,) = asyncio.run(resolve_generator("self_play")(ctx, {"seed": 0}, "t4-s0", "t4"))
    # the tiny model's greedy replies are no moves: TextArena disqualifies it (two invalid moves) at once
    assert traj.status == "completed" and traj.reward == 1.0
    assert traj.metadata["env_info"]["policy_moved"] is False
    assert traj.metadata["env_info"]["game"]["0"]["invalid_move"]


def self_play_run(tmp_path, tiny, script, mode="async"):
    """A coordinator, an in-process queue and a rollout worker playing TicTacToe self-play: 2 games a task,
    batches of 2 groups, one batch of staleness."""
    from agentrl.actors.cluster import Slot
    from agentrl.actors.coordinator import Coordinator
    from agentrl.actors.queue import QueueActor
    from agentrl.actors.rollout import RolloutWorker
    from agentrl.config import load_config
    from agentrl.runner.loop import prepare

    over = {
        "run": {"root": str(tmp_path), "mode": mode},
        "model": {"path": str(tiny)},
        "env": {"name": "textarena", "kwargs": {"game": "TicTacToe-v0", "opponent": "self"}},
        "rollout": {"generator": "self_play", "n_samples_per_prompt": 2, "prompts_per_step": 2,
                    "max_new_tokens": 6, "max_turns": 6},
        "queue": {"max_staleness": 1},
        "engine": {"max_seq_len": 2048},
    }  # fmt: skip
    cfg = prepare(load_config(None, over))
    coord = Coordinator(cfg, str(tmp_path / "run"), str(tiny))
    queue = QueueActor(cfg, str(tmp_path / "run"), serve_http=False)
    worker = RolloutWorker(cfg, str(tiny), Handle(queue), engines=[HFEngine(tiny, script=script)])
    coord.cluster.queue = Slot("queue", 0, Handle(queue))
    coord.cluster.workers = [Slot("rollout", 0, Handle(worker))]
    return coord, queue


def first_free_cell(tok):
    chat = chat_tokens(tok)

    def script(input_ids):
        cell = tok.decode(input_ids).rsplit("Available Moves:", 1)[-1].split("'")[1]
        return [*tok.encode(cell, add_special_tokens=False), chat.eot_id]

    return script


async def test_a_self_play_task_reserves_and_queues_one_complete_group_per_seat(tmp_path, tiny, tok):
    coord, queue = self_play_run(tmp_path, tiny, first_free_cell(tok))
    assert coord.task_trajectories == 4  # 2 games x 2 seats; the window (2 batches of 4) holds two tasks
    tasks = [asyncio.create_task(coord.run_group(i, {"game": "TicTacToe-v0", "seed": i})) for i in range(4)]
    # (reserving 2 per task, four tasks filled the window with reservations and no put of 4 ever fit)
    summaries = await asyncio.wait_for(asyncio.gather(*tasks[:2]), 60)
    assert [s["accepted"] for s in summaries] == [4, 4] and [s["unplayed_groups"] for s in summaries] == [
        0,
        0,
    ]
    assert not any(t.done() for t in tasks[2:])  # their reservations wait for the next policy version
    batch = await queue.sample_batch(8, 0, 5.0)
    groups = {}
    for traj in batch.trajectories:
        groups.setdefault(traj.group_id, []).append(traj)
    assert {g: sorted(t.id for t in ts) for g, ts in groups.items()} == {
        f"t{i}.p{seat}": [f"t{i}-s0.p{seat}", f"t{i}-s1.p{seat}"] for i in (0, 1) for seat in (0, 1)
    }
    for game in {t.id.split(".")[0] for t in batch.trajectories}:  # each game is zero-sum between its seats
        assert sum(t.reward for t in batch.trajectories if t.id.startswith(game + ".")) == 0
    queue.set_policy_version(2)  # the window grows by one batch (one task) per version
    assert [s["accepted"] for s in await asyncio.wait_for(asyncio.gather(*tasks[2:]), 60)] == [4, 4]
    assert queue.tickets == {}
    await queue.close()


def test_self_play_needs_window_slack_for_a_task_that_delivers_less(tmp_path, tiny, tok):
    from agentrl.errors import ConfigError

    with pytest.raises(ConfigError, match=r"run\.mode = 'async' and queue\.max_staleness"):
        self_play_run(tmp_path, tiny, first_free_cell(tok), mode="sync")


async def test_a_seat_that_never_moved_leaves_its_group_out(tmp_path, tiny, tok):
    chat = chat_tokens(tok)
    coord, queue = self_play_run(
        tmp_path, tiny, lambda _ids: [*tok.encode("no", add_special_tokens=False), chat.eot_id]
    )
    summary = await asyncio.wait_for(coord.run_group(0, {"game": "TicTacToe-v0", "seed": 0}), 60)
    # seat 0 is disqualified after two invalid moves: seat 1 never moved in either game
    assert summary["n"] == 2 and summary["accepted"] == 2 and summary["unplayed_groups"] == 1
    # the rest of the task's reservation went back to the window: the next task reserves and delivers
    other = await asyncio.wait_for(coord.run_group(1, {"game": "TicTacToe-v0", "seed": 1}), 60)
    assert other["accepted"] == 2
    assert summary["rewards"] == [-1.0, -1.0]
    batch = await queue.sample_batch(2, 0, 5.0)
    assert sorted(t.id for t in batch.trajectories) == ["t0-s0.p0", "t0-s1.p0"]
    assert queue.queue.status()["pending_groups"] == 0
    assert queue.tickets == {}
    await queue.close()


@pytest.mark.slow
def test_a_self_play_run_trains_every_queued_trajectory_once_in_complete_groups(
    tmp_path, monkeypatch, run_model
):
    from agentrl.config import load_config
    from agentrl.queue.wal import WriteAheadLog
    from agentrl.runner.loop import run
    from tests.run_support import read_jsonl, tiny_config

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    rollout = {"generator": "self_play", "n_samples_per_prompt": 2, "prompts_per_step": 2, "max_new_tokens": 4,
               "max_turns": 3}  # fmt: skip
    path = tiny_config(tmp_path, run_model, env={"name": "textarena"}, rollout=rollout, run={"steps": 3, "eval_every": 0},
                       warmup={"steps": 0}, engine={"max_seq_len": 1024})  # fmt: skip
    with path.open("a") as f:
        f.write('[env.kwargs]\ngame = "TicTacToe-v0"\nopponent = "self"\n')
    summary = run(load_config(path, ["--run.mode", "async", "--queue.max-staleness", "1"]))
    assert summary["ok"] and summary["steps"] == 3
    run_dir = tmp_path / "t"
    ledger = read_jsonl(run_dir / "ledger.jsonl")
    assert [row["step"] for row in ledger] == [1, 2, 3]
    trained = [i for row in ledger for i in row["ids"]]
    assert len(trained) == len(set(trained)) == 12, "a trajectory was trained twice"
    replay = WriteAheadLog(run_dir).replay()
    assert set(trained) <= replay.known_ids  # nothing trained that the queue did not log
    assert set(trained) | set(replay.uncommitted) == replay.known_ids  # nothing queued was lost
    for row in ledger:  # whole groups: a seat's group of a task (`t<i>.p<seat>`) holds its n = 2 games
        groups = {}
        for tid in row["ids"]:
            groups.setdefault((tid.split("-")[0], tid.rsplit(".", 1)[1]), []).append(tid)
        assert all(len(members) == 2 for members in groups.values()), groups

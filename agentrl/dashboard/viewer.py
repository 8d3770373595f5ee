"""The trajectory viewer's data: which trajectories a step trained on, and each one laid out per turn and per
token (text, loss mask, policy version, rollout log-prob, the learner's log-prob and advantage where the
learner sampled it), with the rollout-vs-learner mismatch per turn, and the filters the page offers.
Pictures (a vision-language model's trajectories) are placed where their span starts: the prompt is laid out
as parts (text, picture, text, ...), a response token that opens a picture's span carries it; each picture
is served from the trajectory's own bytes by `Viewer.image` (the dashboard's `/api/images/{id}/{sha256}`).

Sources: the queue's WAL (the trajectories), the ledger (which step consumed which ids), metrics.jsonl (the
policy version each step trained at) and learner_logprobs.jsonl (`agentrl.learners.base`'s sample).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import numpy as np

from agentrl import types
from agentrl.dashboard import runfiles
from agentrl.runlayout import WAL_FILE

# the picture file types a trajectory may hold, by their first bytes (what the page's <img> is told it gets)
IMAGE_TYPES = {
    b"\x89PNG": "image/png",
    b"\xff\xd8\xff": "image/jpeg",
    b"GIF8": "image/gif",
    b"RIFF": "image/webp",
}
MISMATCH_HIGHLIGHT = 0.1  # |rollout - learner| log-prob above which a token / turn is highlighted
QUEUED = -1  # the "step" of trajectories in the log no step has trained yet


@dataclass
class Query:
    step: int | None = None
    id: str = ""
    group: str = ""
    min_reward: float = -float("inf")
    max_reward: float = float("inf")
    min_staleness: int = 0
    min_mismatch: float = 0.0
    limit: int = 64


def layout(traj: types.Trajectory, learner: dict[str, Any] | None, trained_at: int | None, decode) -> dict:
    """One trajectory for the page. `trained_at`: the policy version of the step that trained it (staleness
    is measured from it); `decode`: token id -> text."""
    resp = types.tokens(traj.response_ids)
    n = len(resp)
    loss_mask = types.mask(traj)
    versions = types.expand_versions(traj.versions, n, default=traj.policy_version or 0)
    rollout = types.floats(traj.logprobs) if traj.logprobs is not None else None
    learned = np.asarray(learner["learner_logprobs"], dtype=np.float64) if learner else None
    advantages = learner.get("advantages") if learner else None
    tokens = []
    for i in range(n):
        tok = {
            "id": int(resp[i]),
            "text": decode(int(resp[i])),
            "mask": int(loss_mask[i]),
            "v": int(versions[i]),
        }
        if rollout is not None:
            tok["lp"] = round(float(rollout[i]), 5)
        if learned is not None and i < len(learned):
            tok["llp"] = round(float(learned[i]), 5)
        if advantages is not None and i < len(advantages):
            tok["adv"] = round(float(advantages[i]), 5)
        tokens.append(tok)
    prompt = types.tokens(traj.prompt_ids).tolist()
    pictures = [_picture(traj, s) for s in traj.image_spans or []]
    for picture in pictures:
        if picture["start"] >= len(prompt) and picture["start"] - len(prompt) < n:
            tokens[picture["start"] - len(prompt)]["image"] = picture
    turns = _turns(tokens)
    gaps = [t["mismatch"] for t in turns if t["mismatch"] is not None]
    adv = [t["adv"] for t in tokens if "adv" in t and t["mask"]]
    return {
        "id": traj.id,
        "group_id": traj.group_id or traj.id,
        "env": traj.env,
        "status": traj.status,
        "reward": traj.reward,
        "turn_rewards": traj.turn_rewards,
        "advantage": float(np.mean(adv)) if adv else None,
        "staleness": None if trained_at is None else trained_at - types.min_version(traj),
        "versions": traj.versions,
        "mismatch": max(gaps) if gaps else None,
        "sampled_by_learner": learner is not None,
        "prompt": decode(prompt),
        "prompt_parts": _prompt_parts(prompt, [p for p in pictures if p["start"] < len(prompt)], decode),
        "images": pictures,
        "messages": [{"role": m.role, "content": types.message_text(m.content)} for m in traj.messages or []],
        "metadata": traj.metadata,
        "turns": turns,
    }


def _picture(traj: types.Trajectory, span: types.ImageSpan) -> dict[str, Any]:
    return {"url": f"api/images/{quote(traj.id, safe='')}/{span.sha256}", "sha256": span.sha256,
            "start": span.start, "length": span.length, "grid_thw": list(span.grid_thw)}  # fmt: skip


def _prompt_parts(prompt: list[int], pictures: list[dict[str, Any]], decode) -> list[dict[str, Any]]:
    """The prompt as text and pictures in token order (a picture in place of its span's tokens)."""
    parts: list[dict[str, Any]] = []
    at = 0
    for picture in pictures:
        if picture["start"] > at:
            parts.append({"text": decode(prompt[at : picture["start"]])})
        parts.append({"image": picture})
        at = picture["start"] + picture["length"]
    if at < len(prompt) or not parts:
        parts.append({"text": decode(prompt[at:])})
    return parts


def image_type(data: bytes) -> str:
    """The content type of a picture file (its magic bytes); application/octet-stream when unknown."""
    return next(
        (kind for magic, kind in IMAGE_TYPES.items() if data.startswith(magic)), "application/octet-stream"
    )


def _turns(tokens: list[dict]) -> list[dict]:
    """Runs of equal loss mask: mask 1 = an assistant turn (the policy's tokens), mask 0 = what the env (or a
    tool) said in between. Mismatch of a turn: mean |rollout - learner| log-prob over its loss tokens."""
    turns: list[dict] = []
    for tok in tokens:
        if not turns or turns[-1]["mask"] != tok["mask"]:
            turns.append({"role": "assistant" if tok["mask"] else "env", "mask": tok["mask"], "tokens": []})
        turns[-1]["tokens"].append(tok)
    for turn in turns:
        gaps = [abs(t["lp"] - t["llp"]) for t in turn["tokens"] if t["mask"] and "lp" in t and "llp" in t]
        turn["mismatch"] = round(float(np.mean(gaps)), 5) if gaps else None
        turn["highlight"] = bool(gaps) and turn["mismatch"] > MISMATCH_HIGHLIGHT
    return turns


class Viewer:
    """Reads a run directory on each query (it may be growing); the WAL is re-read only when it changed."""

    def __init__(self, run_dir: Path, decode):
        self.run_dir = Path(run_dir)
        self.decode = decode
        self._wal_key: tuple[int, int] | None = None
        self._wal: dict[str, types.Trajectory] = {}

    def _trajectories(self) -> dict[str, types.Trajectory]:
        try:
            st = (self.run_dir / WAL_FILE).stat()
            key = (st.st_size, st.st_mtime_ns)
        except FileNotFoundError:
            return {}
        if key != self._wal_key:
            self._wal, self._wal_key = runfiles.wal_trajectories(self.run_dir), key
        return self._wal

    def image(self, trajectory_id: str, sha256: str) -> bytes | None:
        """The bytes of picture `sha256` of trajectory `trajectory_id` (None: no such trajectory or picture)."""
        traj = self._trajectories().get(trajectory_id)
        return next((i.data for i in (traj.images or []) if i.sha256 == sha256), None) if traj else None

    def query(self, q: Query) -> dict[str, Any]:
        wal = self._trajectories()
        steps = runfiles.ledger_steps(self.run_dir)
        sampled = runfiles.learner_logprobs(self.run_dir)
        committed = {i for ids in steps.values() for i in ids}
        for tid, row in sampled.items():  # steps trained but not committed yet (until their checkpoint)
            if tid not in committed:
                steps.setdefault(int(row["step"]), []).append(tid)
        step_of = {tid: s for s, ids in steps.items() for tid in ids}
        queued = [tid for tid in wal if tid not in step_of]
        versions = {int(r["step"]): int(r["policy_version"]) - 1 for r in runfiles.read_metrics(self.run_dir)
                    if "policy_version" in r and "phase" not in r}  # fmt: skip
        available = sorted(s for s, ids in steps.items() if any(t in wal for t in ids))
        chosen = None
        if q.id:
            ids = [q.id]
        elif q.group:
            ids = [t for t, traj in wal.items() if (traj.group_id or t) == q.group]
        else:
            chosen = q.step if q.step is not None else (available[-1] if available else QUEUED)
            ids = queued if chosen == QUEUED else steps.get(chosen, [])
        rows, missing = [], 0
        for tid in ids:
            traj = wal.get(tid)
            if traj is None:
                missing += 1
                continue
            step = step_of.get(tid)
            row = layout(
                traj, sampled.get(tid), versions.get(step, (step or 1) - 1) if step else None, self.decode
            )
            row["step"] = step
            if _keep(row, q):
                rows.append(row)
        return {
            "steps": available,
            "queued": len(queued),
            "step": chosen,
            "missing": missing,  # ids the ledger names that the log no longer holds (compacted)
            "total": len(rows),
            "trajectories": rows[: q.limit],
        }


def _keep(row: dict[str, Any], q: Query) -> bool:
    if not q.min_reward <= row["reward"] <= q.max_reward:
        return False
    if q.min_staleness and (row["staleness"] or 0) < q.min_staleness:
        return False
    return not (q.min_mismatch and (row["mismatch"] is None or row["mismatch"] < q.min_mismatch))

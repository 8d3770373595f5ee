"""Learner batches built from normalized trajectories, and their micro-batch splitter.

Layout. A batch holds N sequences (sequence = prompt + response of one trajectory) in R rows of T tokens.
Unpacked (default): R = N, row i = sequence i, right-padded. Packed: several whole sequences share a row,
`position_ids` restart at 0 for each sequence (Hugging Face detects the segments from them when
`attention_mask` is None; Megatron reads `seq_index`).

Alignment (one convention, everywhere): every [R, T] tensor is indexed by TARGET token position. Column t
describes token `input_ids[:, t]`: `loss_mask[:, t] = 1` iff token t is a response token whose trajectory loss
mask is 1; `rollout_logprobs[:, t]` is the engine's log-prob of token t; `token_versions[:, t]` the policy
version that sampled it; learner log-probs `logprobs[:, t] = log_softmax(logits[:, t - 1] / temperature)[token t]`,
so column 0 (and the first token of every packed sequence) never carries loss and its log-prob is 0.

`seq_index[:, t]` is the sequence (0..N-1) of token t, -1 on padding; `turn_index[:, t]` the assistant turn
(0.., one per run of loss tokens) of a loss token, -1 elsewhere; per-sequence tensors (`rewards`,
`group_index`, ...) have length N and stay whole when rows are selected into micro-batches, together with the
full-batch normalisers `total_loss_tokens` and `n_seqs`, so summing micro-batch losses equals the big-batch loss.
Pictures (a vision-language model): `images[r]` lists row r's pictures in token order, `(Image, grid_thw,
start)` per image span (start: the span's first column) (unpacked batches only: the model computes multimodal positions per row); a learner's forward turns
them into pixels. Building does no Python work per token: one loop per trajectory collects numpy views, the rest is
concatenate/repeat/scatter.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from agentrl import types
from agentrl.errors import LearnerError

ROW_TENSORS = (
    "input_ids",
    "attention_mask",
    "position_ids",
    "loss_mask",
    "rollout_logprobs",
    "token_versions",
    "seq_index",
    "advantages",
    "old_logprobs",
    "ref_logprobs",
    "teacher_logprobs",
    "old_values",
    "returns",
    "turn_index",
    "routed_experts",
)


@dataclass
class Batch:
    input_ids: torch.Tensor  # [R, T] int64
    attention_mask: torch.Tensor  # [R, T] int64, 1 on real tokens
    position_ids: torch.Tensor  # [R, T] int64, restart at 0 per sequence
    loss_mask: torch.Tensor  # [R, T] float32, target-aligned
    rollout_logprobs: torch.Tensor  # [R, T] float32, target-aligned, 0 where unknown
    token_versions: torch.Tensor  # [R, T] int64, -1 outside responses
    seq_index: torch.Tensor  # [R, T] int64, sequence of each token, -1 on padding
    rewards: torch.Tensor  # [N] float32
    group_index: torch.Tensor  # [N] int64, 0..n_groups-1 from group_id
    has_rollout_logprobs: torch.Tensor  # [N] bool
    trajectory_ids: list[str]
    n_groups: int
    total_loss_tokens: float  # full-batch normaliser (kept by select)
    n_seqs: int  # full-batch number of sequences (kept by select)
    packed: bool = False
    advantages: torch.Tensor | None = None  # [R, T] float32, filled by agentrl.algorithms
    old_logprobs: torch.Tensor | None = None  # [R, T] proximal log-probs (learner, before the update)
    ref_logprobs: torch.Tensor | None = None  # [R, T] reference-model log-probs
    teacher_logprobs: torch.Tensor | None = None  # [R, T] teacher log-probs (on-policy distillation)
    old_values: torch.Tensor | None = None  # [R, T] critic values before the update (gae)
    returns: torch.Tensor | None = None  # [R, T] value targets (gae)
    turn_index: torch.Tensor | None = (
        None  # [R, T] int64: assistant turn (0..) of each loss token, -1 elsewhere
    )
    # [N, K] float32: the return of sequence i from its assistant turn k on = its reward minus the env's rewards
    # for the turns before k (`Trajectory.turn_rewards`; the whole reward for every turn without them); K = the
    # batch's most turns. Per sequence, like `rewards` (algorithm.credit = "turn")
    turn_returns: torch.Tensor | None = None
    # [R, T, layers, topk] int16 (learner.routing_replay = "rollout"): the experts the engine's router chose at the
    # forward position of token t (the position that reads `input_ids[:, t]`, in every MoE layer), -1 where there
    # is no record (padding, trajectories without one, a sequence's last token); None when not replaying. int16
    # (a quarter of int64: a rollout batch's record is tokens x layers x top-k) holds every expert id of
    # `types.RoutedExperts` (uint8 or int16) and -1; the learners widen a micro-batch's to int64 to index.
    routed_experts: torch.Tensor | None = None
    # per row: its pictures in token order, (Image, grid_thw) per span (see the module docstring); None: no pictures
    images: list[list[tuple[types.Image, tuple[int, int, int], int]]] | None = None
    extra: dict = field(default_factory=dict)
    # Used length of each row as known on the host when the batch was built (kept by `select` of listed rows);
    # None: read from the device. Saves a device read per step: the micro-batch plan and the token count.
    row_tokens: list[int] | None = None

    @property
    def n_rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def n_tokens(self) -> int:
        """Real (non-padding) tokens in these rows."""
        return sum(self.row_lengths_list())

    def row_lengths_list(self) -> list[int]:
        """`row_lengths()` as host ints: `row_tokens` when known, else one read of the device."""
        return list(self.row_tokens) if self.row_tokens is not None else self.row_lengths().tolist()

    @property
    def n_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def row_lengths(self) -> torch.Tensor:
        """Used length of each row (padding is only at the end of a row)."""
        return self.attention_mask.sum(dim=1)

    def to(self, device: str | torch.device) -> Batch:
        """Move every tensor to `device` in place (learners fill fields on the caller's batch); returns self."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                setattr(self, f.name, value.to(device))
        return self

    def select(self, rows: torch.Tensor | Sequence[int], width: int | None = None) -> Batch:
        """The given rows, trimmed to their longest used length (`width` when the caller knows it: no read of
        the device); sequence-level fields and normalisers stay whole.

        `extra["rows"]` records the selected row indices (to scatter per-row results back into the batch).
        """
        picked = None
        if self.row_tokens is not None and not isinstance(rows, torch.Tensor):
            picked = [self.row_tokens[int(r)] for r in rows]
            if width is None:
                width = max(picked, default=1)
        rows = torch.as_tensor(rows, dtype=torch.long, device=self.input_ids.device)
        if width is None:
            width = int(self.row_lengths()[rows].max()) if rows.numel() else 1
        width = max(width, 1)
        changes = {}
        for name in ROW_TENSORS:
            value = getattr(self, name)
            if value is not None:
                changes[name] = value[rows, :width]
        if self.images is not None:
            changes["images"] = [self.images[r] for r in rows.tolist()]
        return dataclasses.replace(self, **changes, extra={**self.extra, "rows": rows}, row_tokens=picked)


def _group_indices(group_ids: list[str]) -> tuple[np.ndarray, int]:
    _, index = np.unique(np.asarray(group_ids, dtype=object).astype(str), return_inverse=True)
    return index.astype(np.int64).reshape(-1), int(index.max()) + 1 if len(group_ids) else 0


def _pack_rows(lengths: np.ndarray, row_tokens: int) -> tuple[np.ndarray, np.ndarray, int]:
    """First-fit-decreasing: row and column offset of each sequence; a sequence longer than a row gets its own."""
    order = np.argsort(-lengths, kind="stable")
    row_of = np.zeros(len(lengths), dtype=np.int64)
    offset_of = np.zeros(len(lengths), dtype=np.int64)
    used: list[int] = []
    for i in order:
        n = int(lengths[i])
        for r, u in enumerate(used):
            if u + n <= row_tokens:
                row_of[i], offset_of[i] = r, u
                used[r] += n
                break
        else:
            row_of[i], offset_of[i] = len(used), 0
            used.append(n)
    return row_of, offset_of, len(used)


def _turns(
    flat_mask: np.ndarray, pos_in_seq: np.ndarray, starts: np.ndarray, s_len: np.ndarray
) -> np.ndarray:
    """Turn index of every loss token: each run of loss tokens (an assistant turn between env/tool tokens) is
    the next turn of its sequence; -1 off the loss mask. Taken before age masking, so turns keep their numbers."""
    on = flat_mask > 0
    prev_on = np.concatenate(([False], on[:-1])) & (pos_in_seq > 0)
    begins = (on & ~prev_on).astype(np.int64)
    count = np.cumsum(begins)
    before = count[starts] - begins[starts]  # turns begun in earlier sequences
    return np.where(on, count - np.repeat(before, s_len) - 1, -1)


def build_batch(
    trajectories: Sequence[types.Trajectory],
    pad_id: int,
    device: str | torch.device = "cpu",
    *,
    pack_tokens: int = 0,
    routed_experts: bool = False,
    images: bool = False,
) -> Batch:
    """Batch of normalized trajectories; `pack_tokens > 0` packs sequences into rows of at most that many tokens;
    `routed_experts` (learner.routing_replay = "rollout") also lays out the trajectories' expert records;
    `images`: the learner trains a vision-language model (trajectories with pictures are refused otherwise)."""
    if not trajectories:
        raise LearnerError("build_batch: no trajectories")
    shown = next((tr for tr in trajectories if tr.images), None)
    if shown is not None and not images:
        raise LearnerError(f"trajectory {shown.id!r} shows pictures but this learner trains a text-only model: "
                           "train a vision-language model with the torch learner (learner.backend = 'torch')")  # fmt: skip
    if shown is not None and pack_tokens > 0:
        raise LearnerError("learner.pack_tokens > 0 with pictures: a vision-language model's multimodal positions "
                           "are computed per row; set learner.pack_tokens = 0")  # fmt: skip
    arrays, has_lp = _per_trajectory(trajectories)
    n = len(trajectories)
    s_len = np.fromiter((len(p) + len(r) for p, r, *_ in arrays), dtype=np.int64, count=n)
    if pack_tokens > 0:
        row_of, col0, n_rows = _pack_rows(s_len, pack_tokens)
    else:
        row_of, col0, n_rows = np.arange(n, dtype=np.int64), np.zeros(n, dtype=np.int64), n
    flat = _Flat.of(arrays, s_len)
    grid = _Grid(flat, row_of, col0, s_len, n_rows)
    group_index, n_groups = _group_indices([t.group_id or t.id for t in trajectories])

    def t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device)

    loss_mask = grid(0.0, np.float32, flat.mask)
    return Batch(
        input_ids=t(grid(pad_id, np.int64, flat.tokens)),
        attention_mask=t(grid(0, np.int64, 1)),
        position_ids=t(grid.position_ids(flat.pos_in_seq)),
        loss_mask=t(loss_mask),
        rollout_logprobs=t(grid(0.0, np.float32, flat.logprobs)),
        token_versions=t(grid(-1, np.int64, flat.versions)),
        seq_index=t(grid(-1, np.int64, flat.seq_of)),
        turn_index=t(grid(-1, np.int64, flat.turns)),
        rewards=t(np.array([tr.reward for tr in trajectories], dtype=np.float32)),
        turn_returns=t(_turn_returns(trajectories, int(flat.turns.max(initial=-1)) + 1)),
        group_index=t(group_index),
        has_rollout_logprobs=t(has_lp),
        trajectory_ids=[tr.id for tr in trajectories],
        n_groups=n_groups,
        total_loss_tokens=float(loss_mask.sum()),
        n_seqs=n,
        packed=pack_tokens > 0,
        advantages=t(np.zeros((n_rows, grid.width), dtype=np.float32)),
        row_tokens=np.bincount(row_of, weights=s_len, minlength=n_rows).astype(np.int64).tolist(),
        routed_experts=_routed_experts(trajectories, s_len, grid, t) if routed_experts else None,
        images=_images(trajectories) if shown is not None else None,
    )


def _turn_returns(trajectories: Sequence[types.Trajectory], n_turns: int) -> np.ndarray:
    """[N, n_turns]: reward minus the env's rewards of the earlier turns (env step k follows assistant turn k)."""
    out = np.zeros((len(trajectories), max(n_turns, 1)), dtype=np.float64)
    for i, tr in enumerate(trajectories):
        earlier = np.zeros(out.shape[1])
        given = np.asarray((tr.turn_rewards or [])[: out.shape[1] - 1], dtype=np.float64)
        earlier[1 : 1 + len(given)] = np.cumsum(given)
        earlier[1 + len(given) :] = earlier[len(given)]
        out[i] = tr.reward - earlier
    return out.astype(np.float32)


def _images(
    trajectories: Sequence[types.Trajectory],
) -> list[list[tuple[types.Image, tuple[int, int, int], int]]]:
    """Each (unpacked) row's pictures in token order, one per span, with the span's start."""
    out = []
    for tr in trajectories:
        stored = {img.sha256: img for img in tr.images or ()}
        out.append([(stored[s.sha256], tuple(s.grid_thw), s.start) for s in tr.image_spans or ()])
    return out


def _routed_experts(
    trajectories: Sequence[types.Trajectory], s_len: np.ndarray, grid: _Grid, t
) -> torch.Tensor | None:
    """The trajectories' expert records in the batch layout ([R, T, layers, topk], -1 where none); None when no
    trajectory has one (the learner then routes every token itself)."""
    records = [(i, types.routed_expert_ids(tr.routed_experts)) for i, tr in enumerate(trajectories)
               if tr.routed_experts is not None]  # fmt: skip
    if not records:
        return None
    shape = records[0][1].shape[1:]
    starts = np.concatenate(([0], np.cumsum(s_len)[:-1]))
    flat = np.full((int(s_len.sum()), *shape), -1, dtype=np.int16)
    for i, ids in records:
        tr = trajectories[i]
        if ids.shape[1:] != shape:
            raise LearnerError(
                f"build_batch: trajectory {tr.id!r}: routed_experts has {ids.shape[1]} layers x top-{ids.shape[2]}, "
                f"trajectory {trajectories[records[0][0]].id!r} {shape[0]} x top-{shape[1]} (one model per batch)"
            )
        if len(ids) > s_len[i]:
            raise LearnerError(
                f"build_batch: trajectory {tr.id!r}: routed_experts covers {len(ids)} positions, "
                f"more than its {int(s_len[i])} tokens"
            )
        flat[starts[i] : starts[i] + len(ids)] = ids
    return t(grid(-1, np.int16, flat))


def _per_trajectory(
    trajectories: Sequence[types.Trajectory],
) -> tuple[list[tuple[np.ndarray, ...]], np.ndarray]:
    """(prompt, response, loss mask, rollout log-probs, versions) arrays of each trajectory (the only loop over
    trajectories), and whether each had rollout log-probs (zeros stand in where not)."""
    arrays = []
    has_lp = np.zeros(len(trajectories), dtype=bool)
    for i, traj in enumerate(trajectories):
        p, r = types.tokens(traj.prompt_ids), types.tokens(traj.response_ids)
        mask = types.mask(traj)
        if traj.logprobs is not None:
            lp = types.floats(traj.logprobs)
            has_lp[i] = True
        else:
            lp = np.zeros(len(r), dtype=np.float32)
        versions = types.expand_versions(traj.versions, len(r), default=traj.policy_version or 0)
        if len(mask) != len(r) or len(lp) != len(r) or len(versions) != len(r):
            raise LearnerError(
                f"build_batch: trajectory {traj.id!r} is not normalized (per-token arrays differ)"
            )
        arrays.append((p, r, mask, lp, versions))
    return arrays, has_lp


@dataclass
class _Flat:
    """The token stream of all sequences back to back: sequence i occupies [starts[i], starts[i] + s_len[i])."""

    tokens: np.ndarray
    pos_in_seq: np.ndarray  # position of each token within its sequence
    seq_of: np.ndarray  # sequence of each token
    mask: np.ndarray  # loss mask (response tokens, never a sequence's first token)
    logprobs: np.ndarray  # rollout log-probs on response tokens, 0 elsewhere
    versions: np.ndarray  # sampling policy version on response tokens, -1 elsewhere
    turns: np.ndarray  # assistant turn of each loss token, -1 elsewhere

    @classmethod
    def of(cls, arrays: list[tuple[np.ndarray, ...]], s_len: np.ndarray) -> _Flat:
        prompts, responses, masks, logprobs, versions = zip(*arrays, strict=True)
        n = len(arrays)
        p_len = np.fromiter((len(p) for p in prompts), dtype=np.int64, count=n)
        r_len = s_len - p_len
        starts = np.concatenate(([0], np.cumsum(s_len)[:-1]))
        total = int(s_len.sum())
        tokens = np.concatenate([a for pair in zip(prompts, responses, strict=True) for a in pair])
        pos_in_seq = np.arange(total, dtype=np.int64) - np.repeat(starts, s_len)
        seq_of = np.repeat(np.arange(n, dtype=np.int64), s_len)
        r_starts = np.concatenate(([0], np.cumsum(r_len)[:-1]))
        resp_pos = np.repeat(starts + p_len, r_len) + np.arange(int(r_len.sum())) - np.repeat(r_starts, r_len)
        mask = np.zeros(total, dtype=np.float32)
        mask[resp_pos] = np.concatenate(masks)
        mask[pos_in_seq == 0] = 0.0  # the first token of a sequence has no predicting logit
        lp = np.zeros(total, dtype=np.float32)
        lp[resp_pos] = np.concatenate(logprobs)
        ver = np.full(total, -1, dtype=np.int64)
        ver[resp_pos] = np.concatenate(versions)
        turns = _turns(mask, pos_in_seq, starts, s_len)
        return cls(tokens, pos_in_seq, seq_of, mask, lp, ver, turns)


class _Grid:
    """Scatters flat per-token values into the [rows, width] layout (sequence i at row `row_of[i]`, from
    column `col0[i]`)."""

    def __init__(self, flat: _Flat, row_of: np.ndarray, col0: np.ndarray, s_len: np.ndarray, n_rows: int):
        self.n_rows = n_rows
        self.width = int((col0 + s_len).max())
        self.used = np.zeros(n_rows, dtype=np.int64)
        np.maximum.at(self.used, row_of, col0 + s_len)
        cols = np.repeat(col0, s_len) + flat.pos_in_seq
        self.flat_index = np.repeat(row_of, s_len) * self.width + cols

    def __call__(self, fill, dtype, values) -> np.ndarray:
        """[rows, width, *trailing] from per-token `values` ([tokens, *trailing], or a scalar)."""
        trailing = np.shape(values)[1:]
        out = np.full((self.n_rows * self.width, *trailing), fill, dtype=dtype)
        out[self.flat_index] = values
        return out.reshape(self.n_rows, self.width, *trailing)

    def position_ids(self, pos_in_seq: np.ndarray) -> np.ndarray:
        """Each token's position in its sequence; the padding after a row's last sequence counts from 0 again."""
        position_ids = np.maximum(np.arange(self.width, dtype=np.int64)[None, :] - self.used[:, None], 0)
        position_ids.reshape(-1)[self.flat_index] = pos_in_seq
        return position_ids


def sft_batch(
    pairs: Sequence[tuple[Sequence[int] | np.ndarray, Sequence[int] | np.ndarray]],
    pad_id: int,
    device: str | torch.device = "cpu",
) -> Batch:
    """Batch for supervised warm-up from (prompt_ids, response_ids) pairs: loss on every response token."""
    trajs = [
        types.Trajectory(id=str(i), prompt_ids=types.pack_tokens(p), response_ids=types.pack_tokens(r))
        for i, (p, r) in enumerate(pairs)
    ]
    return build_batch(trajs, pad_id, device)


def mini_batches(batch: Batch, n: int) -> list[Batch]:
    """`learner.minibatches`: the rows split into `n` contiguous parts, one optimizer update each.

    Unlike a micro-batch, a mini-batch is a whole objective: its normalisers (`total_loss_tokens`, `n_seqs`)
    are its own (verl's ppo_mini_batch_size), so every update has the scale of a full-batch update. Rows hold
    whole sequences, so GSPO's sequence ratios and per-sequence weights stay exact. `n = 1` returns the batch.
    """
    if n == 1:
        return [batch]
    if n > batch.n_rows:
        raise LearnerError(f"learner.minibatches = {n} exceeds the {batch.n_rows} rows of this batch")
    out = []
    for rows in np.array_split(np.arange(batch.n_rows), n):
        mb = batch.select(rows.tolist())
        seqs = mb.seq_index[mb.seq_index >= 0].unique()
        out.append(
            dataclasses.replace(mb, total_loss_tokens=float(mb.loss_mask.sum()), n_seqs=int(seqs.numel()))
        )
    return out


def micro_batches(batch: Batch, micro_batch_tokens: int) -> list[Batch]:
    """Split rows into micro-batches whose padded size (rows x longest row) fits `micro_batch_tokens`.

    Rows are taken longest first, so similar lengths share a micro-batch; a row longer than the budget is alone.
    """
    lengths = batch.row_lengths_list()  # known on the host, or one read of the device: planned on the host
    order = sorted(range(len(lengths)), key=lambda r: -lengths[r])  # stable: equal lengths keep row order
    groups: list[tuple[list[int], int]] = []
    current: list[int] = []
    width = 0
    for r in order:
        n = lengths[r]
        if current and (len(current) + 1) * max(width, n) > micro_batch_tokens:
            groups.append((current, width))
            current, width = [], 0
        current.append(r)
        width = max(width, n)
    if current:
        groups.append((current, width))
    if len(groups) == 1 and width == batch.input_ids.shape[1]:  # select() would copy every tensor unchanged
        rows = torch.arange(len(order), device=batch.input_ids.device)
        return [dataclasses.replace(batch, extra={**batch.extra, "rows": rows})]
    return [batch.select(sorted(g), width=w) for g, w in groups]

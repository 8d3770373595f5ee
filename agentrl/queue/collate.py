"""Padded numpy arrays from a list of normalized trajectories (numpy only; callers wrap with torch.from_numpy).

Row i is prompt + response of trajectory i, right-padded to the longest row. Token bytes are copied row by
row with `np.frombuffer` slices (one memcpy per array per row, no Python loop over tokens).
"""

from __future__ import annotations

import numpy as np

from agentrl.types import LOGPROB_DTYPE, MASK_DTYPE, TOKEN_DTYPE, Trajectory, expand_versions


def pad_batch(trajectories: list[Trajectory], pad_id: int = 0) -> dict[str, np.ndarray]:
    """input_ids [B,T] int64, loss_mask [B,T] float32 (response tokens with mask 1), logprobs [B,T] float32
    (behaviour policy, 0 where absent), versions [B,T] int64 (-1 outside responses), prompt_lens,
    lengths [B] int64, rewards [B] float32."""
    b = len(trajectories)
    prompt_lens = np.fromiter((len(t.prompt_ids) // 4 for t in trajectories), np.int64, b)
    response_lens = np.fromiter((len(t.response_ids) // 4 for t in trajectories), np.int64, b)
    lengths = prompt_lens + response_lens
    width = int(lengths.max()) if b else 0
    input_ids = np.full((b, width), pad_id, dtype=np.int64)
    loss_mask = np.zeros((b, width), dtype=np.float32)
    logprobs = np.zeros((b, width), dtype=np.float32)
    versions = np.full((b, width), -1, dtype=np.int64)
    for i, traj in enumerate(trajectories):
        p, n = int(prompt_lens[i]), int(response_lens[i])
        input_ids[i, :p] = np.frombuffer(traj.prompt_ids, TOKEN_DTYPE)
        input_ids[i, p : p + n] = np.frombuffer(traj.response_ids, TOKEN_DTYPE)
        if traj.loss_mask is None:
            loss_mask[i, p : p + n] = 1.0
        else:
            loss_mask[i, p : p + n] = np.frombuffer(traj.loss_mask, MASK_DTYPE)
        if traj.logprobs is not None:
            logprobs[i, p : p + n] = np.frombuffer(traj.logprobs, LOGPROB_DTYPE)
        if traj.versions is not None and len(traj.versions) == 1:
            versions[i, p : p + n] = traj.versions[0][0]
        else:
            versions[i, p : p + n] = expand_versions(traj.versions, n)
    rewards = np.fromiter((t.reward for t in trajectories), np.float32, b)
    return {
        "input_ids": input_ids,
        "loss_mask": loss_mask,
        "logprobs": logprobs,
        "versions": versions,
        "prompt_lens": prompt_lens,
        "lengths": lengths,
        "rewards": rewards,
    }

"""The serving side of the config: the replay queue with its HTTP front door, and the live dashboard. Light:
no torch or ray.
"""

from __future__ import annotations

from typing import Annotated, Literal

from agentrl.config.base import _Section, doc


class QueueSection(_Section):
    key = "queue"
    host: Annotated[str, doc("address the queue's HTTP front door listens on")] = "127.0.0.1"
    port: Annotated[int, doc("HTTP port; 0 = any free port", ge=0, le=65535)] = 0
    token: Annotated[
        str,
        doc(
            "bearer token HTTP clients must send; empty = $AGENTRL_QUEUE_TOKEN, else queue.token_file, else none "
            "(refused off loopback); never written to the run directory"
        ),
    ] = ""
    token_file: Annotated[
        str,
        doc(
            "file whose first line is the bearer token: its path is kept in the run's config, so `--resume` "
            "reads the token again (the token itself never is)"
        ),
    ] = ""
    max_staleness: Annotated[
        int, doc("most versions a trajectory may lag the learner; run.mode = 'sync' runs with 0", ge=0)
    ] = 1
    stale_policy: Annotated[Literal["drop", "keep"], doc("what happens to a too-stale trajectory")] = "drop"
    group_size: Annotated[
        int,
        doc(
            "trajectories per group released together; 1 in `agentrl run`: rollout.n_samples_per_prompt", ge=1
        ),
    ] = 1
    group_timeout_s: Annotated[float, doc("seconds an incomplete group waits for straggler_policy", gt=0)] = (
        120.0
    )
    straggler_policy: Annotated[
        Literal["release", "drop"], doc("an incomplete group at its timeout is released as is, or dropped")
    ] = "release"
    max_trajectories: Annotated[int, doc("trajectories the queue holds before refusing puts", ge=1)] = 100_000
    max_bytes: Annotated[int, doc("bytes the queue holds before refusing puts", ge=1)] = 2 << 30
    max_body_bytes: Annotated[int, doc("largest HTTP request body (413 above)", ge=1)] = 64 << 20
    max_image_bytes: Annotated[
        int, doc("largest image file in a submitted trajectory (`images[].data`; 413 above)", ge=1)
    ] = 16 << 20
    batch_size: Annotated[
        int,
        doc(
            "trajectories per learner step for the admission window; 0 = no window. `agentrl run` ignores it "
            "and uses rollout.prompts_per_step x rollout.n_samples_per_prompt",
            ge=0,
        ),
    ] = 0
    external_share: Annotated[
        float,
        doc("part of the staleness window rollout reservations leave to HTTP submissions", ge=0, lt=1),
    ] = 0.0
    retry_after_s: Annotated[float, doc("Retry-After a refused put is told to wait", ge=0)] = 1.0
    read_timeout_s: Annotated[
        float, doc("client sends headers and body within this (slowloris): 408", gt=0)
    ] = 30.0
    wal: Annotated[bool, doc("keep a write-ahead log so accepted trajectories survive a restart")] = True
    fsync: Annotated[
        bool,
        doc(
            "acknowledge (202, put returns) only once an fsync covers the record (group commit: concurrent "
            "puts share one); false: acknowledged = in the page cache (survives a process kill, not a "
            "machine crash)"
        ),
    ] = True
    compact_every: Annotated[int, doc("compact the log every this many commits; 0 = never", ge=0)] = 50


class DashboardSection(_Section):
    key = "dashboard"
    enabled: Annotated[bool, doc("serve the live dashboard from the driver of `agentrl run`")] = True
    host: Annotated[str, doc("address the dashboard listens on (loopback by default)")] = "127.0.0.1"
    port: Annotated[int, doc("dashboard port; 0 = any free port", ge=0, le=65535)] = 0
    token: Annotated[
        str,
        doc(
            "bearer token (or ?token=) the page and clients must send; empty = none on loopback, a generated "
            "one otherwise; also $AGENTRL_DASHBOARD_TOKEN"
        ),
    ] = ""
    logprob_samples: Annotated[
        int,
        doc(
            "trajectories per learner step whose per-token learner log-probs and advantages go to "
            "runs/NAME/learner_logprobs.jsonl (the trajectory viewer's mismatch); 0 = none",
            ge=0,
            le=64,
        ),
    ] = 4

"""Self-play game outcomes per policy version, read from a run's queue log (every trajectory ever put).

    python bench/textarena_games.py runs/textarena_tictactoe [--block 5]

A game is the trajectories `t<i>-s<k>.p<seat>` of one `t<i>-s<k>`; its policy version is the oldest token
version in it. Prints, per block of versions: games, the share ended by an invalid move (a disqualification),
won by TextArena's win condition, drawn, and moves per game (TextArena's turn counts).
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

from agentrl.queue import recovery
from agentrl.queue.wal import PutRecord
from agentrl.runlayout import WAL_FILE
from agentrl.types import expand_versions, n_response


def games(run_dir: Path) -> dict[str, dict[int, object]]:
    trajs = []
    data = (run_dir / WAL_FILE).read_bytes()
    recovery.scan(data, lambda r: trajs.extend(r.trajectories) if isinstance(r, PutRecord) else None)
    out: dict[str, dict[int, object]] = defaultdict(dict)
    for traj in trajs:
        out[traj.id.rsplit(".", 1)[0]][traj.metadata["seat"]] = traj
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--block", type=int, default=5, help="policy versions per row")
    args = parser.parse_args()
    rows: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for seats in games(args.run_dir).values():
        traj = next(iter(seats.values()))
        version = min(expand_versions(traj.versions, n_response(traj), default=0))
        info = traj.metadata["env_info"]
        row = rows[version // args.block]
        row["games"] += 1
        row["invalid"] += any(info[s].get("invalid_move") for s in ("0", "1"))
        row["won"] += "has won" in info["0"].get("reason", "")
        row["draw"] += "draw" in info["0"].get("reason", "")
        row["moves"] += info["0"].get("turn_count", 0) + info["1"].get("turn_count", 0)
    print("| policy versions | games | ended by an invalid move | won | draws | moves per game |")
    print("|---|---|---|---|---|---|")
    for block in sorted(rows):
        r, n = rows[block], rows[block]["games"]
        first = block * args.block
        print(
            f"| {first}–{first + args.block - 1} | {n:.0f} | {r['invalid'] / n:.2f} | {r['won'] / n:.2f} | "
            f"{r['draw'] / n:.2f} | {r['moves'] / n:.1f} |"
        )


if __name__ == "__main__":
    main()

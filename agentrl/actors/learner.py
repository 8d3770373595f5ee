"""LearnerWorker: the learner (torch or Megatron) behind one process, fed its data-parallel slice of each batch.

`fetch(queue, ids)` pulls this rank's slice of the next batch from the queue actor (agentrl.actors.queue) and
`train()` builds a `Batch` of it, takes learner.minibatches x learner.epochs optimizer updates (the learner's
`policy_version` becomes v+1 once, after the last) and returns the learner's metrics. `warmup(steps)` runs the
supervised phase on env demonstrations, a chunk of steps per call (`warmup_end()` ends it early) (loss on assistant tokens only, tokenized exactly as the multi-turn
generator does). `weights_payload()` /`save_hf()` /
`distributed_source()` feed agentrl.actors.broadcast; all but `save_hf()` (full weights) send the learner's
`published_weights()` (the adapter alone under LoRA), logged with their size; the learners name MoE experts one
by one there, as checkpoints and SGLang do (their `weights()`). `save_archive()` /
`load_archive()` move checkpoints as bytes when the learner runs on another node than the run directory.
Plain class: agentrl.actors.remote makes it a Ray actor.

A learner of several ranks (TP x PP x DP > 1) is one LearnerWorker per rank (agentrl.actors.learner_group), each
started with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT in its environment. Every method runs on every rank
(weights are gathered collectively), but only rank 0 returns payloads, writes HF directories and talks to the
engines; the other ranks take part in the collectives and return nothing.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from agentrl.actors.common import set_threads
from agentrl.config import Config
from agentrl.types import Trajectory

log = logging.getLogger(__name__)


def make_learner(cfg: Config, model_path: str):
    common = dict(temperature=cfg.rollout.temperature, seed=cfg.run.seed)
    if cfg.learner.kind == "megatron":
        from agentrl.learners.megatron import MegatronLearner

        return MegatronLearner(model_path, cfg.learner, cfg.algorithm, compile=cfg.learner.compile, **common)
    from agentrl.learners.torch_learner import TorchLearner

    return TorchLearner(
        model_path, cfg.learner, cfg.algorithm, true_on_policy=cfg.run.true_on_policy, **common
    )


class LearnerWorker:
    def __init__(self, cfg: Config, model_path: str):
        set_threads(cfg)
        import torch

        torch.manual_seed(cfg.run.seed)
        from agentrl.tokenizer import load_tokenizer

        self.rank = int(os.environ.get("RANK", "0"))
        if os.environ.get("AGENTRL_LOCAL_RANK_FROM_RAY") == "1":
            _local_rank_from_ray()

        self.cfg = cfg
        self.model_path = model_path
        self.tokenizer = load_tokenizer(model_path)
        self.learner = make_learner(cfg, model_path)
        self.learner.logprob_samples = cfg.dashboard.logprob_samples
        self._group = None
        self._slice: list[Trajectory] | None = None  # pulled by `fetch`, trained on by the next `train()`
        self._writer: Any = None  # the thread of background checkpoint saves (`save`), made on first use
        self._saving: Any = None  # its Future while a save is being written
        self._warmup: Any = None  # the warm-up in progress (agentrl.actors.warmup.Warmup), made by warmup()

    @property
    def pad_id(self) -> int:
        tok = self.tokenizer
        return tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)

    def policy_version(self) -> int:
        return int(self.learner.policy_version)

    def learner_version(self) -> int:
        return self.policy_version()

    def info(self) -> dict[str, Any]:
        return self.learner.info()

    # -- training ----------------------------------------------------------------------------------------

    def fetch(self, queue: Any, ids: list[str]) -> int:
        """Pull this rank's data-parallel slice of the next batch (`ids`, whole groups) from the queue actor: the
        trajectories reach this process alone, and the next `train()` trains on them. Returns how many."""
        import ray

        self._slice = ray.get(queue.sampled.remote(ids))
        return len(self._slice)

    def train(self, trajectories: list[Trajectory] | None = None) -> tuple[int, dict[str, Any]]:
        """This rank's data-parallel slice of one rollout batch (the one `fetch` pulled, unless given; the whole
        batch when the learner has one data-parallel rank): (the policy_version it produced, the step's learner
        metrics). The version travels on its own, not inside the metrics: the driver's RunState takes it from
        here and is its only other holder. The batch's rollout metrics (rewards, staleness, lengths) come from
        the queue."""
        from agentrl.learners.batch import build_batch

        if trajectories is None:
            trajectories, self._slice = self._slice, None
            if trajectories is None:
                raise RuntimeError("LearnerWorker.train() without trajectories needs a fetch() first")
        t0 = time.perf_counter()
        if (
            self.cfg.run.deterministic
        ):  # arrival order varies between runs; which sample id got which tokens too
            trajectories = sorted(
                trajectories, key=lambda t: (t.group_id, t.prompt_ids, t.response_ids, t.id)
            )
        replay = self.cfg.learner.routing_replay == "rollout"
        batch = build_batch(trajectories, self.pad_id, self.cfg.learner.device, routed_experts=replay,
                            images=self.learner.takes_images)  # fmt: skip
        stats = self.learner.train_step(batch, sliced=True)
        return self.policy_version(), {
            **{f"train/{k}": float(v) for k, v in stats.items()},
            "train_s": time.perf_counter() - t0,
            "logprob_sample": self.learner.logprob_sample,  # the driver writes it to learner_logprobs.jsonl
        }

    def data_rank(self) -> tuple[int, int]:
        """(data-parallel rank, data-parallel size): which slice of each rollout batch this rank trains on."""
        return self.learner.data_rank()

    def warmup(self, steps: int = 0) -> dict[str, Any]:
        """Supervised warm-up on env demonstrations (agentrl.actors.warmup): up to `steps` more SFT steps (0:
        until `warmup.steps`, `warmup.time_limit_s` or `warmup.stop_loss` ends it); its stats, with
        `warmup_ended` once it is over (the optimizer then reset for RL)."""
        from agentrl.actors.warmup import Warmup

        if self._warmup is None:
            self._warmup = Warmup(self.cfg, self.learner, self.tokenizer, self.pad_id)
        return self._warmup.advance(steps)

    def warmup_end(self) -> dict[str, Any]:
        """End the warm-up where it is (`warmup.stop_eval` reached); its final stats."""
        if self._warmup is None:
            raise RuntimeError("LearnerWorker.warmup_end() before any warmup()")
        return self._warmup.end()

    # -- weights and checkpoints -------------------------------------------------------------------------

    def _drain(self) -> None:
        """Ranks > 0: take part in gathering the weights, keep nothing."""
        for _ in self.learner.published_weights():
            pass

    def weights_payload(self) -> dict[str, Any]:
        """`{hf_name: cpu tensor}`: returned through Ray's object store (one put, shared by every engine)."""
        if self.rank != 0:
            self._drain()
            return {}
        out = {
            name: t.detach().to("cpu", copy=True).contiguous() for name, t in self.learner.published_weights()
        }
        return self._logged(out)

    def local_weights(self):
        return self._logged(dict(self.learner.published_weights()))

    def _logged(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """Log what one publish sends (the adapter alone is MBs where full weights are GBs)."""
        self.last_publish_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        log.info(
            "publish policy_version %d: %d tensors, %.3f MB%s", self.policy_version(), len(tensors),
            self.last_publish_bytes / 1e6, " (LoRA adapter only)" if self.cfg.learner.lora.enabled else "",
        )  # fmt: skip
        return tensors

    def save_hf(self, path: str) -> str:
        """Write the current weights as a Hugging Face directory (the `disk` publish path)."""
        from agentrl.learners.hf_io import save_hf_dir

        if self.rank != 0:
            self._drain()
            return path
        save_hf_dir(path, self.learner.weights(), self.model_path)
        return path

    def save_adapter(self, path: str) -> Any:
        """Write the LoRA adapter as a PEFT directory (the `disk` path to SGLang under LoRA); drop the ones
        published two or more versions ago (SGLang has read them into memory when it loaded them)."""
        import shutil
        from pathlib import Path

        from agentrl.engines.base import AdapterSource

        self.learner.save_adapter_dir(path)  # collective on a Megatron learner: every rank calls it
        if self.rank != 0:
            return None
        target = Path(path)
        keep = {target.name, f"lora_v{self.policy_version() - 1}"}
        for old in target.parent.glob("lora_v*"):
            if old.name not in keep:
                shutil.rmtree(old, ignore_errors=True)
        return AdapterSource(str(target.resolve()))

    def init_weight_group(
        self, master_address: str, master_port: int, world_size: int, group_name: str
    ) -> None:
        """Host the weight-broadcast group as rank 0 (blocks until every engine joined)."""
        from agentrl.engines.weight_sync import init_weights_update_group

        backend = "nccl" if "cuda" in self.cfg.learner.device else "gloo"
        self._group = init_weights_update_group(
            master_address, master_port, 0, world_size, backend, group_name
        )

    def distributed_source(self) -> Any:
        """The sources of one `nccl` publish: one per engine update call, in broadcast order."""
        from agentrl.engines.weight_sync import describe_publish

        if self.rank != 0:
            return self._drain()
        items = list(self._logged(dict(self.learner.published_weights())).items())
        return describe_publish(self._group.name, items, self._bucket_bytes)

    def broadcast_weights(self) -> None:
        """Rank 0 side of the `nccl` publish path (as `distributed_source` described it); the engines
        receive concurrently."""
        from agentrl.engines.weight_sync import send_publish
        from agentrl.errors import WeightSyncError

        if self.rank != 0:
            return self._drain()
        if self._group is None:
            raise WeightSyncError(
                "learner.publish = 'nccl': no weight-broadcast group (init_weight_group first)"
            )
        send_publish(self._group, self.learner.published_weights(), self._bucket_bytes)

    @property
    def _bucket_bytes(self) -> int:
        return int(self.cfg.learner.publish_bucket_mb * (1 << 20))

    def save(self, path: str, background: bool = False) -> None:
        """The learner's checkpoint into `path`. With `background`, only its copy to host memory happens here
        (every rank, collectives included) and a thread writes the files while the next steps train:
        `wait_saved` returns once they are written. One save at a time: a second waits for the first."""
        self.wait_saved()
        if not background:
            self.learner.save(path)
            return
        write = self.learner.begin_save(path)
        if self._writer is None:
            from concurrent.futures import ThreadPoolExecutor

            self._writer = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-writer")
        self._saving = self._writer.submit(write)

    def wait_saved(self) -> None:
        """Until the background save (if any) has written this rank's files; raises what the writer raised."""
        saving, self._saving = self._saving, None
        if saving is not None:
            saving.result()

    def load(self, path: str) -> int:
        self.wait_saved()
        self.learner.load(path)
        return self.policy_version()

    def save_archive(self) -> bytes:
        """`save` into a directory on this node, returned packed: the driver on another node writes it into
        the run directory (agentrl.actors.cluster). Every rank returns the files it wrote."""
        from agentrl.actors.transfer import save_packed

        return save_packed(self.save)

    def load_archive(self, data: bytes) -> int:
        """`load` a checkpoint the driver sent packed from its run directory."""
        from agentrl.actors.transfer import load_packed

        return load_packed(data, self.load)


def _local_rank_from_ray() -> None:
    """LOCAL_RANK = the device index of the GPU Ray gave this actor: 0 when Ray narrowed CUDA_VISIBLE_DEVICES to
    it, its physical index when RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES keeps every GPU visible."""
    import ray

    gpus = ray.get_gpu_ids()
    if gpus:
        keep_all = os.environ.get("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES") == "1"
        os.environ["LOCAL_RANK"] = str(int(gpus[0]) if keep_all else 0)

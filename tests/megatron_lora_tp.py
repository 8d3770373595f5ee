"""Two gloo ranks, TP = 2 and PP = 2, the Megatron learner's GPU code path on CPU (megatron_fake_cuda): LoRA vs
torch + peft.

Usage (from the repo root): python -m tests.megatron_lora_tp MODEL_DIR OUT_DIR  -> OUT_DIR/rank{0,1}.json (test_megatron_lora.py).
"""

import json
import os
import sys

SUBSET = ("q_proj", "v_proj", "up_proj", "down_proj")


def worker(rank: int, world: int, model_dir: str, out_dir: str, port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from tests.megatron_fake_cuda import fake_cuda, gpu_path_class

    fake_cuda()
    from agentrl.config.learning import AlgorithmSection, LearnerSection
    from tests.megatron_lora_helpers import ALGO, SETTINGS, compare, lora_section, torch_learner

    learner_class = gpu_path_class()
    results = {}
    for name, tp, pp, targets in (("tp2", 2, 1, ("all-linear",)), ("tp2-subset", 2, 1, SUBSET),
                                  ("pp2", 1, 2, ("all-linear",))):  # fmt: skip
        lc = LearnerSection(kind="megatron", tensor_parallel=tp, pipeline_parallel=pp, lora=lora_section(targets),
                            **SETTINGS)  # fmt: skip
        mega = learner_class(model_dir, lc, AlgorithmSection(**ALGO))
        results[name] = compare(mega, torch_learner(model_dir, targets), 300)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    import torch.multiprocessing as mp

    from agentrl.net import free_port

    mp.spawn(worker, args=(2, sys.argv[1], sys.argv[2], free_port()), nprocs=2)

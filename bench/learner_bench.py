"""Learner benchmarks (not a test).

(a) `python bench/learner_bench.py batch`: `build_batch` of 256 trajectories (prompt 256 + response 1024 tokens,
    float32 logprobs, loss mask, two version runs) against a baseline that builds the same padded tensors the
    usual way (`torch.tensor(list)` per trajectory, `pad_sequence`, per-token version lists). Median ms per batch.
(b) `python bench/learner_bench.py train` (GPU): `TorchLearner.train_step` (GRPO, bf16 autocast over fp32
    parameters, micro_batch_tokens 16384) on the Qwen3-0.6B architecture (random init) with 8 x 2048 tokens,
    against a plain HF forward + backward + AdamW step in the same script and the same precision setup.
    Prints tokens/s and MFU = 6 * params * tokens/s / peak (989 TFLOP/s bf16 dense; attention FLOPs excluded).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import torch

from agentrl import types


def make_trajs(n: int, prompt: int, response: int) -> list[types.Trajectory]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        lp = -rng.random(response, dtype=np.float32)
        mask = np.ones(response, dtype=np.uint8)
        mask[response // 2 : response // 2 + 16] = 0
        t = types.Trajectory(
            id=str(i),
            group_id=str(i // 8),
            prompt_ids=types.pack_tokens(rng.integers(0, 150_000, prompt)),
            response_ids=types.pack_tokens(rng.integers(0, 150_000, response)),
            loss_mask=mask.tobytes(),
            logprobs=types.pack_floats(lp),
            versions=[(3, response // 2), (4, response - response // 2)],
            reward=float(i % 2),
        )
        out.append(types.normalize(t))
    return out


def baseline_batch(trajs: list[types.Trajectory], pad_id: int) -> dict[str, torch.Tensor]:
    pad = torch.nn.utils.rnn.pad_sequence
    ids, masks, lps, vers = [], [], [], []
    for t in trajs:
        p, r = types.tokens(t.prompt_ids).tolist(), types.tokens(t.response_ids).tolist()
        ids.append(torch.tensor(p + r))
        masks.append(torch.tensor([0] * len(p) + types.mask(t).tolist(), dtype=torch.float32))
        lps.append(torch.tensor([0.0] * len(p) + types.floats(t.logprobs).tolist()))
        per_token = [v for v, n in t.versions for _ in range(n)]
        vers.append(torch.tensor([-1] * len(p) + per_token))
    return {
        "input_ids": pad(ids, batch_first=True, padding_value=pad_id),
        "loss_mask": pad(masks, batch_first=True),
        "logprobs": pad(lps, batch_first=True),
        "versions": pad(vers, batch_first=True, padding_value=-1),
        "position_ids": torch.arange(max(len(x) for x in ids)).expand(len(ids), -1),
    }


def bench_batch(args) -> None:
    from agentrl.learners.batch import build_batch

    trajs = make_trajs(args.n, args.prompt_len, args.response_len)

    def median_ms(fn) -> float:
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    ours = median_ms(lambda: build_batch(trajs, 0))
    packed = median_ms(lambda: build_batch(trajs, 0, pack_tokens=4096))
    base = median_ms(lambda: baseline_batch(trajs, 0))
    n_tok = args.n * (args.prompt_len + args.response_len)
    print(f"build_batch {args.n} x {args.prompt_len}+{args.response_len} tokens ({n_tok / 1e3:.0f}k tokens)")
    print(f"  baseline (torch.tensor(list) + pad_sequence): {base:8.1f} ms")
    print(f"  agentrl build_batch (padded):                 {ours:8.1f} ms   {base / ours:5.1f}x faster")
    print(f"  agentrl build_batch (packed, 4096/row):       {packed:8.1f} ms   {base / packed:5.1f}x faster")


def qwen3_06b_config():
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=151_936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40_960,
        rms_norm_eps=1e-6, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )  # fmt: skip


def hf_step_fn(model, args):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    ids = torch.randint(0, 150_000, (args.rows, args.seq_len), device="cuda")
    mb_rows = max(1, args.micro_batch_tokens // args.seq_len)

    def step():
        for i in range(0, args.rows, mb_rows):
            x = ids[i : i + mb_rows]
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=x, labels=x).loss
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def bench_train(args) -> None:
    import tempfile

    from transformers import AutoModelForCausalLM

    from agentrl.config.learning import AlgorithmSection, LearnerSection
    from agentrl.learners.batch import build_batch
    from agentrl.learners.torch_learner import TorchLearner

    assert torch.cuda.is_available(), "the train benchmark needs a GPU"
    torch.backends.cuda.matmul.allow_tf32 = True
    seq, rows = args.seq_len, args.rows
    tmp = tempfile.mkdtemp()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(qwen3_06b_config(), dtype=torch.float32)
    model.save_pretrained(tmp)
    n_params = sum(p.numel() for p in model.parameters())
    tokens = rows * seq
    peak = 989e12

    def report(name: str, step_s: float) -> float:
        tps = tokens / step_s
        print(
            f"  {name:34s} {step_s * 1e3:7.1f} ms/step {tps / 1e3:7.1f}k tok/s  MFU {6 * n_params * tps / peak:5.1%}"
        )
        return tps

    def timed(step, warmup: int = 2) -> float:
        for _ in range(warmup):
            step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / args.steps

    print(
        f"Qwen3-0.6B architecture ({n_params / 1e6:.0f}M params), {rows} x {seq} tokens, {torch.cuda.get_device_name()}"
    )
    base = report("HF fwd+bwd+AdamW (bf16 autocast)", timed(hf_step_fn(model.cuda().train(), args)))
    print(f"  peak memory: {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    del model
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()

    learner = TorchLearner(
        tmp,
        LearnerSection(device="cuda", dtype="bfloat16", lr=1e-6, micro_batch_tokens=args.micro_batch_tokens),
        AlgorithmSection(
            advantage="grpo", off_policy=args.off_policy, recompute_proximal=args.recompute_proximal
        ),
    )
    trajs = make_trajs(rows, 256, seq - 256)
    batch = build_batch(trajs, learner.pad_id, device="cuda")
    name = f"TorchLearner.train_step ({args.off_policy}{', recompute' if args.recompute_proximal else ''})"
    ours = report(name, timed(lambda: learner.train_step(batch)))
    print(f"  ratio agentrl / HF baseline: {ours / base:.2f}")
    print(f"  peak memory: {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["batch", "train"])
    parser.add_argument("--n", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--response-len", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--micro-batch-tokens", type=int, default=16384)
    parser.add_argument("--off-policy", default="none", choices=["none", "tis", "decoupled"])
    parser.add_argument("--recompute-proximal", action="store_true")
    args = parser.parse_args()
    bench_batch(args) if args.what == "batch" else bench_train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

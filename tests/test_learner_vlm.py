"""The torch learner on the tiny Qwen2.5-VL: its log-probs of trajectories with pictures equal the embedded
engine's that sampled them, a step trains the language model with the vision tower frozen or trained
(`learner.vision_tower`), the published weights load into the engine, and a text-only learner refuses pictures."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import torch

from agentrl import types
from agentrl.chat import chat_tokens
from agentrl.config.learning import AlgorithmSection, LearnerSection
from agentrl.engines.base import SamplingParams, TensorSource
from agentrl.engines.embedded import EmbeddedEngine
from agentrl.envs import make_env
from agentrl.errors import LearnerError
from agentrl.learners import hf_io
from agentrl.learners.batch import build_batch
from agentrl.learners.torch_learner import TorchLearner
from agentrl.tokenizer import load_tokenizer

torch.set_num_threads(2)


async def sampled(path, engine: EmbeddedEngine, n: int = 4) -> list[types.Trajectory]:
    """Single-turn `shapes` episodes (and one without a picture) sampled by the engine, as trajectories."""
    chat = chat_tokens(load_tokenizer(path))
    env = make_env("shapes", {})
    openings = [env.opening(task) for task in env.sample_tasks(seed=0, n=n - 1)]
    openings.append([types.Message("user", "What is 2 + 3?")])
    out = []
    for i, opening in enumerate(openings):
        ids, spans = chat.place_images(chat.prompt_ids(opening), opening)
        pictures = [types.image(p) for p in types.message_images(opening)]
        gen = await engine.generate(
            ids, SamplingParams(max_new_tokens=6, seed=i, ignore_eos=True), images=pictures or None
        )
        out.append(types.normalize(types.Trajectory(
            id=f"t{i}", group_id="g", prompt_ids=ids, response_ids=gen.output_ids, logprobs=gen.logprobs,
            versions=gen.versions, reward=float(i % 2), images=pictures or None, image_spans=spans or None)))  # fmt: skip
    return out


def visual(learner) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in learner.model.named_parameters() if ".visual." in f".{n}"}


async def generate_again(engine, traj):
    """The engine's 4 seeded tokens after `traj`'s prompt and pictures (once new weights are loaded)."""
    sampling = SamplingParams(max_new_tokens=4, seed=9, ignore_eos=True)
    return await engine.generate(types.tokens(traj.prompt_ids).tolist(), sampling, images=traj.images)


def learner_agrees(learner, prompt, again):
    """The trajectory of `again` and the learner's log-probs of it, which equal the engine's within 1e-4."""
    traj = types.normalize(types.Trajectory(
        id="after", prompt_ids=prompt.prompt_ids, response_ids=again.output_ids, logprobs=again.logprobs,
        images=prompt.images, image_spans=prompt.image_spans))  # fmt: skip
    logp = learner.compute_logprobs(build_batch([traj], learner.pad_id, images=True))
    assert (logp[0, -4:] - torch.tensor(again.logprobs)).abs().max() <= 1e-4
    return traj, logp


async def test_learner_matches_the_engine_and_trains_the_vlm(tiny_vlm):
    engine = EmbeddedEngine(str(tiny_vlm), max_batch_size=4, max_seq_len=256)
    try:
        trajs = await sampled(tiny_vlm, engine)
        assert sum(t.images is not None for t in trajs) == 3
        algo = AlgorithmSection(advantage="grpo", off_policy="none")
        learner = TorchLearner(
            tiny_vlm, LearnerSection(lr=1e-2, micro_batch_tokens=256, vision_tower="frozen"), algo
        )
        batch = build_batch(trajs, learner.pad_id, images=learner.takes_images)
        logp = learner.compute_logprobs(batch)
        for i, traj in enumerate(trajs):
            row, cols = (batch.seq_index == i).nonzero(as_tuple=True)
            got = logp[row, cols][-types.n_response(traj) :]
            assert (got - torch.from_numpy(types.floats(traj.logprobs).copy())).abs().max() <= 1e-4

        frozen = visual(learner)
        language = learner.model.get_input_embeddings().weight.detach().clone()
        learner.train_step(build_batch(trajs, learner.pad_id, images=True))
        assert all(torch.equal(p, frozen[n]) for n, p in visual(learner).items())
        assert not torch.equal(learner.model.get_input_embeddings().weight, language)

        # the published weights load into the engine, which then agrees with the learner again
        await engine.update_weights(1, TensorSource(dict(learner.weights())))
        again = await generate_again(engine, trajs[0])
    finally:
        await engine.close()
    learner_agrees(learner, trajs[0], again)

    trained = TorchLearner(tiny_vlm, LearnerSection(lr=1e-2, micro_batch_tokens=256), algo)
    before = visual(trained)
    trained.train_step(build_batch(trajs, trained.pad_id, images=True))
    assert any(not torch.equal(p, before[n]) for n, p in visual(trained).items())


def test_pictures_need_a_vision_learner_and_unpacked_rows(tiny_vlm):
    engine = EmbeddedEngine(str(tiny_vlm), max_batch_size=4, max_seq_len=256)
    try:
        trajs = asyncio.run(sampled(tiny_vlm, engine, n=2))
    finally:
        asyncio.run(engine.close())
    with pytest.raises(LearnerError, match="text-only model"):
        build_batch(trajs, 0)
    with pytest.raises(LearnerError, match="pack_tokens"):
        build_batch(trajs, 0, pack_tokens=512, images=True)


def test_the_megatron_learner_refuses_a_vlm_naming_the_torch_learner(tiny_vlm):
    from transformers import AutoConfig

    from agentrl.learners.megatron.arch import ArchSpec

    with pytest.raises(LearnerError, match=r"vision-language model.*learner\.kind = 'torch'"):
        ArchSpec.from_hf(AutoConfig.from_pretrained(tiny_vlm))


def test_warmup_demonstrations_carry_their_pictures(tiny_vlm):
    """The warm-up's demonstrations of `shapes_zoom` hold both pictures (the task's and the zoom) placed as a
    rollout places them, and supervised steps on them lower the loss."""
    from agentrl.actors.warmup import demonstration_batch
    from agentrl.config import Config

    env = make_env("shapes_zoom", {})
    demos = demonstration_batch(Config(), env, load_tokenizer(tiny_vlm), env.sample_tasks(seed=0, n=2), "t")
    demos = [types.normalize(d) for d in demos]
    assert all(len(d.images) == 2 and len(d.image_spans) == 2 for d in demos)
    assert all(
        d.image_spans[1].start >= types.tokens(d.prompt_ids).size for d in demos
    )  # the zoom: env feedback
    learner = TorchLearner(tiny_vlm, LearnerSection(micro_batch_tokens=512))
    losses = [
        learner.sft_step(build_batch(demos, learner.pad_id, images=True), lr=1e-2)["loss"] for _ in range(4)
    ]
    assert losses[-1] < losses[0]


def test_a_checkpoint_keeps_the_image_processor(tiny_vlm, tmp_path):
    """A saved VLM learner loads back as one (its directory keeps preprocessor_config.json), as `--resume` and
    `agentrl export` read it."""
    learner = TorchLearner(tiny_vlm, LearnerSection())
    learner.save(str(tmp_path / "ckpt"))
    again = TorchLearner(tmp_path / "ckpt", LearnerSection())
    assert again.takes_images and again.vision == learner.vision


def test_published_weights_carry_the_checkpoint_names(tiny_vlm):
    """A publish names the weights as the model's checkpoint files do (`visual.*`, `model.layers.*`), not as
    transformers 5 holds them in memory (`model.visual.*`, `model.language_model.*`): SGLang's in-place update
    (`load_weights`) takes only the file names, raising on an unknown vision name and skipping an unknown
    language-model one without a word."""
    learner = TorchLearner(tiny_vlm, LearnerSection())
    files = set(hf_io.load_weights(tiny_vlm))
    published = [name for name, _ in learner.weights()]
    assert len(published) == len(set(published))
    assert set(published) == files - ({"lm_head.weight"} if learner.tied else set())
    assert any(name.startswith("visual.") for name in published)


def fsdp_vlm_worker(rank: int, port: int, model: str, tmp: str) -> None:
    import os

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))  # fmt: skip
    torch.set_num_threads(1)
    trajs = torch.load(f"{tmp}/trajs.pt", weights_only=False)
    learner = TorchLearner(model, FSDP_VLM(True), AlgorithmSection(advantage="grpo", off_policy="none"))
    batch = build_batch(trajs, learner.pad_id, images=True)
    out = {"logprobs": learner.compute_logprobs(batch), "metrics": learner.train_step(batch)}
    out["weights"] = {k: v.clone() for k, v in learner.weights()}
    torch.save(out, f"{tmp}/rank{rank}.pt")
    torch.distributed.destroy_process_group()


def FSDP_VLM(fsdp: bool) -> LearnerSection:  # 64 tokens a micro-batch: each rank gets pictured rows
    return LearnerSection(lr=1e-2, micro_batch_tokens=64, fsdp=fsdp, vision_tower="trained")


def test_fsdp_two_ranks_train_the_vlm_as_one_process(tiny_vlm, tmp_path):
    """FSDP2 on 2 gloo ranks (each decoder layer and vision block sharded) equals the single-process learner
    on trajectories with pictures: log-probs, loss, and every updated weight, the vision tower's included."""
    import torch.multiprocessing as mp

    from agentrl.net import free_port

    engine = EmbeddedEngine(str(tiny_vlm), max_batch_size=4, max_seq_len=256)
    try:
        trajs = asyncio.run(sampled(tiny_vlm, engine))
    finally:
        asyncio.run(engine.close())
    torch.save(trajs, tmp_path / "trajs.pt")
    single = TorchLearner(tiny_vlm, FSDP_VLM(False), AlgorithmSection(advantage="grpo", off_policy="none"))
    batch = build_batch(trajs, single.pad_id, images=True)
    logprobs, metrics = single.compute_logprobs(batch), single.train_step(batch)
    assert metrics["micro_batches"] >= 2
    mp.spawn(fsdp_vlm_worker, args=(free_port(), str(tiny_vlm), str(tmp_path)), nprocs=2)
    weights = dict(single.weights())
    assert any(".visual." in f".{n}" for n in weights)
    for rank in range(2):
        out = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert float((out["logprobs"] - logprobs).abs().max()) <= 1e-5
        assert abs(out["metrics"]["loss"] - metrics["loss"]) <= 1e-5 * max(1.0, abs(metrics["loss"]))
        assert out["weights"].keys() == weights.keys()
        assert max(float((out["weights"][k] - weights[k]).abs().max()) for k in weights) <= 1e-5


async def test_lora_trains_the_language_model_and_the_engine_merges_it(tiny_vlm):
    """LoRA on the VLM: adapters only in the language model (the vision tower's `mlp.down_proj` is not
    adapted), and the published adapter, named as transformers names the language model in memory, merges into
    the embedded engine, which then gives the learner's log-probs."""
    from agentrl.config.learning import LoraSection

    engine = EmbeddedEngine(str(tiny_vlm), max_batch_size=4, max_seq_len=256)
    try:
        trajs = await sampled(tiny_vlm, engine)
        lora = LoraSection(rank=4, target_modules=["q_proj", "v_proj", "down_proj"])
        algo = AlgorithmSection(advantage="grpo", off_policy="none")
        learner = TorchLearner(
            tiny_vlm, LearnerSection(lr=1e-2, micro_batch_tokens=256, lora=lora, reference_model=True), algo
        )
        trained = [n for n, p in learner.model.named_parameters() if p.requires_grad]
        assert trained and all(".language_model." in n and ".lora_" in n for n in trained)
        learner.train_step(build_batch(trajs, learner.pad_id, images=True))
        adapter = dict(learner.published_weights())
        assert any(".mlp.down_proj.lora_B" in n for n in adapter)
        await engine.update_weights(1, TensorSource(adapter))
        again = await generate_again(engine, trajs[0])
    finally:
        await engine.close()
    traj, logp = learner_agrees(learner, trajs[0], again)
    before = learner.compute_ref_logprobs(build_batch([traj], learner.pad_id, images=True))
    assert (logp[0, -4:] - before[0, -4:]).abs().max() > 1e-4  # the adapter changed what the engine serves


async def test_a_sampled_image_placeholder_token_is_text_to_the_learner_as_to_the_engine(tiny_vlm):
    """An untrained VLM samples its own `<|image_pad|>` now and then: the engine decodes it as a text token, and
    the learner's forward must too (transformers would take it for a picture's place: a features/tokens mismatch
    that stopped runs), giving the engine's log-probs for every token, those after it included; in the next
    turn, with a new picture, the engine tells the sampled placeholder from the pictures' runs."""
    from agentrl.envs.shapes import ShapesZoomEnv

    engine = EmbeddedEngine(str(tiny_vlm), max_batch_size=64, max_seq_len=512)
    image_id = engine.vision.image_token_id
    chat = chat_tokens(load_tokenizer(tiny_vlm))
    task = make_env("shapes", {}).sample_tasks(seed=0, n=1)[0]
    opening = make_env("shapes", {}).opening(task)
    ids, spans = chat.place_images(chat.prompt_ids(opening), opening)
    pictures = [types.image(p) for p in types.message_images(opening)]
    try:
        gens = await asyncio.gather(*(engine.generate(
            ids, SamplingParams(max_new_tokens=64, seed=s, ignore_eos=True), images=pictures) for s in range(64)))  # fmt: skip
        gen = next((g for g in gens if image_id in g.output_ids[:-1]), None)
        assert gen is not None, (
            "no response of 64 x 64 sampled tokens held the image placeholder before its end"
        )
        zoom = [ShapesZoomEnv().zoomed(task, 1)]
        delta, more = chat.place_images(chat.delta_ids(zoom, gen.output_ids), zoom)
        before = len(ids) + len(gen.output_ids)
        turn2 = ids + gen.output_ids + delta
        both = pictures + [types.image(p) for p in types.message_images(zoom)]
        gen2 = await engine.generate(
            turn2, SamplingParams(max_new_tokens=8, seed=1, ignore_eos=True), images=both
        )
    finally:
        await engine.close()
    learner = TorchLearner(tiny_vlm, LearnerSection(micro_batch_tokens=512))
    placed = [*spans, *(msgspec.structs.replace(s, start=s.start + before) for s in more)]
    for prompt, out, shown, where in ((ids, gen, pictures, spans), (turn2, gen2, both, placed)):
        traj = types.normalize(types.Trajectory(
            id="stray", prompt_ids=prompt, response_ids=out.output_ids, logprobs=out.logprobs, images=shown,
            image_spans=where))  # fmt: skip
        logp = learner.compute_logprobs(build_batch([traj], learner.pad_id, images=True))
        assert (logp[0, -len(out.output_ids) :] - torch.tensor(out.logprobs)).abs().max() <= 1e-4

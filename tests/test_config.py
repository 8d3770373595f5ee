"""Config: TOML + dotted overrides, unknown keys named with the closest valid one, dry-run rendering."""

import msgspec
import pytest

from agentrl.config import Config, load_config
from agentrl.config.learning import LearnerSection
from agentrl.config.rollout import EngineSection, RolloutSection
from agentrl.config.text import dump_toml, parse_overrides, unwrap
from agentrl.errors import ConfigError


def test_overrides_use_dashes_and_types(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[run]\nmode = "async"\n[queue]\nmax_staleness = 4\n')
    cfg = load_config(
        path, ["--queue.max-staleness", "2", "--run.name=exp", "--engine.external-urls", '["http://a"]']
    )
    assert cfg.queue.max_staleness == 2 and cfg.run.name == "exp" and cfg.engine.external_urls == ["http://a"]


def test_unknown_key_names_closest():
    with pytest.raises(ConfigError, match=r"queue\.max_stalenes.*did you mean 'queue\.max_staleness'"):
        load_config(None, ["--queue.max-stalenes", "2"])
    with pytest.raises(ConfigError, match="unknown config key 'qeue'"):
        load_config(None, {"qeue": {}})


def test_wrong_type_names_path():
    with pytest.raises(ConfigError, match=r"queue\.max_staleness"):
        load_config(None, ["--queue.max-staleness", '"many"'])


def test_open_tables_pass_through():
    cfg = load_config(None, ["--engine.sglang.args.mem-fraction-static", "0.7"])
    assert cfg.engine.sglang.args == {"mem_fraction_static": 0.7}


def test_sync_runs_with_zero_staleness_without_overwriting_the_setting():
    cfg = load_config(None, ["--run.mode", "sync", "--queue.max-staleness", "3"])
    assert cfg.queue.max_staleness == 3 and cfg.effective_max_staleness == 0
    assert cfg.run_queue().max_staleness == 0  # what the run's replay queue gets
    assert (
        load_config(None, ["--run.mode", "async", "--queue.max-staleness", "3"]).effective_max_staleness == 3
    )


def test_dump_round_trips(tmp_path):
    cfg = load_config(None, ["--run.mode", "async", "--env.kwargs.max-number", "9"])
    path = tmp_path / "out.toml"
    path.write_text(dump_toml(cfg))
    assert load_config(path) == cfg


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="needs a value"):
        parse_overrides(["--run.name"])
    with pytest.raises(ConfigError, match="unexpected argument"):
        parse_overrides(["name"])


def test_external_share_range_named():
    with pytest.raises(ConfigError, match=r"queue\.external_share"):
        load_config(None, ["--queue.external-share", "1.5"])


def test_nccl_publish_settings_named():
    with pytest.raises(
        ConfigError, match=r"learner\.publish = 'nccl' needs run\.placement = 'disaggregated'.*'split'"
    ):
        load_config(None, ["--learner.publish", "nccl"])
    with pytest.raises(ConfigError, match=r"learner\.publish_bucket_mb must be >= 0"):
        load_config(None, ["--learner.publish-bucket-mb", "-1"])
    with pytest.raises(ConfigError, match=r"learner\.device and engine\.device.*'cuda' and 'cpu'"):
        load_config(None, ["--learner.publish", "nccl", "--run.placement", "disaggregated",
                           "--learner.device", "cuda"])  # fmt: skip
    cfg = load_config(None, ["--learner.publish", "nccl", "--run.placement", "disaggregated",
                             "--learner.publish-bucket-mb", "256"])  # fmt: skip
    assert cfg.learner.publish_bucket_mb == 256.0


def test_update_mode_auto_is_abort_for_sglang_keep_for_embedded():
    assert load_config(None, []).effective_update_mode == "keep"
    sglang = ["--engine.kind", "sglang", "--engine.device", "cuda"]
    assert load_config(None, sglang).engine.update_mode == "auto"  # the setting as given
    assert load_config(None, sglang).effective_update_mode == "abort"
    assert load_config(None, [*sglang, "--engine.update-mode", "keep"]).effective_update_mode == "keep"


def test_enum_error_lists_the_valid_choices(tmp_path):
    with pytest.raises(
        ConfigError, match=r"^run\.mode = 'asink' is not valid: choose one of 'sync', 'async'$"
    ):
        load_config(None, ["--run.mode", "asink"])
    path = tmp_path / "c.toml"
    path.write_text('[algorithm]\nadvantage = "gpro"\n')
    with pytest.raises(ConfigError, match=r"algorithm\.advantage = 'gpro' .*'grpo', 'dr_grpo', 'rloo'"):
        load_config(path)


def test_a_table_given_whole_on_the_command_line_replaces_the_file_table(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[env]\nname = "calculator"\nkwargs = { low = 10, high = 49, ops = "+" }\n')
    assert load_config(path, ["--env.kwargs", "{}"]).env.kwargs == {}
    assert load_config(path, ["--env.kwargs", "{ high = 20 }"]).env.kwargs == {"high": 20}
    assert load_config(path, ["--env.kwargs.low", "5"]).env.kwargs == {"low": 5, "high": 49, "ops": "+"}


def test_out_of_bounds_value_is_one_line_naming_key_and_bound(tmp_path):
    with pytest.raises(ConfigError, match=r"^queue\.port must be >= 0 and <= 65535, got 70000$"):
        load_config(None, ["--queue.port", "70000"])
    path = tmp_path / "c.toml"
    path.write_text("[rollout]\ntop_p = 0.0\n")
    with pytest.raises(ConfigError, match=r"^rollout\.top_p must be > 0 and <= 1, got 0\.0$"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"^engine\.sglang\.max_restarts must be >= 0, got -1$"):
        load_config(None, ["--engine.sglang.max-restarts", "-1"])
    with pytest.raises(ConfigError, match=r"^rollout\.num_workers must be >= 1, got 0$"):
        RolloutSection(num_workers=0)  # built directly, not loaded: the same bound, the same words


def test_every_field_has_a_description():
    def walk(struct, prefix):
        for f in msgspec.structs.fields(struct):
            tp, meta = unwrap(f.type)
            yield prefix + f.name, meta
            if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
                yield from walk(tp, f"{prefix}{f.name}.")

    missing = [key for key, meta in walk(Config, "") if meta is None or not meta.description]
    assert not missing, f"fields without a description: {missing}"


def test_a_sections_own_checks_are_its_validate_with_the_load_messages():
    cases = [
        (EngineSection(kind="sglang"), ["--engine.kind", "sglang"], r"engine\.kind = 'sglang' needs"),
        (LearnerSection(fsdp=True, kind="megatron"), ["--learner.fsdp", "true", "--learner.kind", "megatron"],
         r"learner\.fsdp = true needs learner\.kind = 'torch'"),
        (LearnerSection(data_parallel=2), ["--learner.data-parallel", "2"],
         r"learner\.data_parallel = 2 with learner\.kind = 'torch' needs learner\.fsdp = true"),
        (LearnerSection(expert_parallel=2, data_parallel=2, fsdp=True),
         ["--learner.expert-parallel", "2", "--learner.data-parallel", "2", "--learner.fsdp", "true"],
         r"learner\.expert_parallel = 2 needs learner\.kind = 'megatron'"),
        (LearnerSection(kind="megatron", expert_parallel=2, data_parallel=3),
         ["--learner.kind", "megatron", "--learner.expert-parallel", "2", "--learner.data-parallel", "3"],
         r"learner\.expert_parallel = 2 must divide learner\.data_parallel = 3"),
        (LearnerSection(dtype="bfloat16"), ["--learner.dtype", "bfloat16"],
         r"learner\.dtype = 'bfloat16' needs learner\.device = 'cuda' with the torch learner"),
    ]  # fmt: skip
    for section, flags, message in cases:
        with pytest.raises(ConfigError, match=message):
            section.validate()
        with pytest.raises(ConfigError, match=message):
            load_config(None, flags)


def test_old_combined_advantage_values_load_as_estimator_plus_loss(tmp_path):
    path = tmp_path / "c.toml"
    for old, advantage, loss in [
        ("gspo", "grpo", "gspo"),
        ("cispo", "grpo", "cispo"),
        ("ppo", "gae", "ppo_clip"),
    ]:
        path.write_text(f'[algorithm]\nadvantage = "{old}"\n')
        with pytest.warns(
            FutureWarning, match=rf"algorithm\.advantage = '{old}' is deprecated: use advantage = "
        ):
            cfg = load_config(path)
        assert (cfg.algorithm.advantage, cfg.algorithm.loss) == (advantage, loss)
        assert f'advantage = "{advantage}"' in dump_toml(
            msgspec.to_builtins(cfg)
        )  # the run dir shows the new keys
    with pytest.warns(FutureWarning):
        assert (
            load_config(path, ["--algorithm.advantage", "gspo"]).algorithm.effective_loss_agg
            == "seq_mean_token_mean"
        )
    with pytest.raises(
        ConfigError, match=r"algorithm\.advantage = 'gspo' .* conflicts with algorithm\.loss = 'cispo'"
    ):
        load_config(None, ["--algorithm.advantage", "gspo", "--algorithm.loss", "cispo"])


def test_algorithm_needs_come_from_the_registry():
    gae = load_config(None, ["--algorithm.advantage", "gae"]).algorithm.needs()
    assert gae.value_head and not gae.teacher and not gae.reference_model
    grpo = load_config(
        None, ["--algorithm.kl-coef", "0.1", "--algorithm.kl-mode", "reward"]
    ).algorithm.needs()
    assert grpo.reference_model and grpo.proximal_logprobs and not grpo.value_head
    assert load_config(None).algorithm.needs(updates=2).proximal_logprobs
    with pytest.raises(ConfigError, match=r"algorithm\.advantage = 'opd' needs algorithm\.teacher"):
        load_config(None, ["--algorithm.advantage", "opd"])
    with pytest.raises(ConfigError, match=r"algorithm\.loss = 'clip' is not valid: choose one of 'ppo_clip'"):
        load_config(None, ["--algorithm.loss", "clip"])
    mixed = load_config(None, ["--algorithm.teacher", "t", "--algorithm.teacher-coef", "0.5"]).algorithm
    assert mixed.needs().teacher and mixed.estimator.level == "sequence"
    assert (
        not load_config(None, ["--algorithm.teacher", "t", "--algorithm.teacher-coef", "0"])
        .algorithm.needs()
        .teacher
    )

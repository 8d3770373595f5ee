"""Wire format: normalization, validation messages, msgpack/JSON round trips."""

import math

import numpy as np
import pytest

from agentrl import types as T
from agentrl.errors import InvalidTrajectory
from agentrl.queue.client import packed


def make(**kw):
    base = dict(id="t1", prompt_ids=[1, 2, 3], response_ids=[4, 5], logprobs=[-0.5, -1.0], policy_version=3)
    base.update(kw)
    return T.Trajectory(**base)


def test_normalize_packs_arrays_and_folds_version():
    t = T.normalize(make())
    assert isinstance(t.prompt_ids, bytes) and isinstance(t.response_ids, bytes)
    assert T.tokens(t.prompt_ids).tolist() == [1, 2, 3]
    assert T.floats(t.logprobs).tolist() == [-0.5, -1.0]
    assert t.versions == [(3, 2)] and t.policy_version is None
    assert t.group_id == "t1" and t.created_at > 0
    assert T.mask(t).tolist() == [1, 1]


def test_all_ones_mask_is_dropped_and_partial_mask_kept():
    assert T.normalize(make(loss_mask=[1, 1])).loss_mask is None
    assert T.mask(T.normalize(make(loss_mask=[1, 0]))).tolist() == [1, 0]


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        (dict(loss_mask=[1]), "loss_mask"),
        (dict(loss_mask=[1, 2]), "loss_mask"),
        (dict(logprobs=[-1.0]), "logprobs"),
        (dict(logprobs=[-1.0, math.nan]), "logprobs"),
        (dict(logprobs=[-1.0, 0.5]), "logprobs"),
        (dict(reward=math.inf), "reward"),
        (dict(policy_version=-1), "policy_version"),
        (dict(policy_version=None, versions=[(1, 1)]), "versions"),
        (dict(policy_version=None, versions=[(-2, 2)]), "versions[0]"),
        (dict(response_ids=[]), "response_ids"),
        (dict(prompt_ids=[-1]), "prompt_ids"),
        (dict(id=""), "id"),
        (dict(response_ids=b"\x01\x00\x00"), "response_ids"),
        (dict(versions=[(1, 2)]), "policy_version"),
        (dict(logprobs=[-1.0, -1e30]), "logprobs"),
        (dict(response_ids=T.Packed("float32", b"\0" * 8)), "response_ids.dtype"),
        (dict(response_ids=T.Packed("int64", b"\0" * 12)), "response_ids"),
        (dict(response_ids=[4.5, 5]), "response_ids"),
        (dict(metadata={"k": {"n": 2**64}}), "metadata.k.n"),
        (dict(metadata={"k": [object()]}), "metadata.k[0]"),
    ],
)
def test_invalid_fields_are_named(kw, field):
    with pytest.raises(InvalidTrajectory) as err:
        T.normalize(make(**kw))
    assert err.value.field == field


def test_arrays_are_read_in_the_dtype_they_declare():
    """int64 [8, 2] is [8, 2], never its bytes read as int32 ([8, 0, 2, 0])."""
    int64 = np.array([8, 2], dtype=np.int64)
    for value in (int64, T.Packed("int64", int64.tobytes()), packed(int64), [8.0, 2]):
        t = T.normalize(make(response_ids=value))
        assert T.tokens(t.response_ids).tolist() == [8, 2], value
    t = T.normalize(make(logprobs=T.Packed("float64", np.array([-0.5, -2.0]).tobytes())))
    assert T.floats(t.logprobs).tolist() == [-0.5, -2.0]


def test_max_version_refuses_versions_from_the_future():
    T.normalize(make(policy_version=3), max_version=3)
    for kw, field in (
        (dict(policy_version=4), "policy_version"),
        (dict(policy_version=None, versions=[(3, 1), (5, 1)]), "versions[1]"),
    ):
        with pytest.raises(InvalidTrajectory) as err:
            T.normalize(make(**kw), max_version=3)
        assert err.value.field == field


def test_vocab_bound():
    with pytest.raises(InvalidTrajectory, match="outside the vocabulary"):
        T.normalize(make(response_ids=[4, 50]), vocab_size=50)
    T.normalize(make(response_ids=[4, 49]), vocab_size=50)


def test_default_version_stamps_unversioned():
    t = T.normalize(make(policy_version=None), default_version=7)
    assert t.versions == [(7, 2)] and T.min_version(t) == 7


def test_version_runs_round_trip():
    per_token = [0, 0, 1, 1, 1, 3]
    runs = T.version_runs(per_token)
    assert runs == [(0, 2), (1, 3), (3, 1)]
    assert T.expand_versions(runs, 6).tolist() == per_token
    t = T.normalize(make(policy_version=None, response_ids=list(range(6)), logprobs=None, versions=runs))
    assert (T.min_version(t), T.max_version(t)) == (0, 3)


def test_msgpack_and_json_round_trip():
    t = T.normalize(make(metadata={"k": [1, "x"]}, turn_rewards=[0.5]))
    for body, ctype in (
        (T.encode_msgpack([t, t]), "application/msgpack"),
        (T.encode_json(t), "application/json"),
    ):
        out = T.decode_trajectories(body, ctype)
        assert out[0] == t


def test_bodies_logged_before_declared_dtypes_still_decode_as_int32():
    """A WAL replays request bodies as received: bare bytes (base64 in JSON) were little-endian int32."""
    body = b'{"id": "a", "prompt_ids": [1, 2], "response_ids": "BAAAAAUAAAA=", "reward": 1}'
    (t,) = T.decode_trajectories(body, "application/json")
    assert T.tokens(T.normalize(t).response_ids).tolist() == [4, 5]


def test_unknown_field_rejected_with_name():
    with pytest.raises(InvalidTrajectory) as err:
        T.decode_trajectories(b'{"id": "a", "bogus": 1}', "application/json")
    assert err.value.field == "bogus"


def test_token_view_is_zero_copy():
    t = T.normalize(make(response_ids=np.arange(4096).tolist(), logprobs=None))
    view = T.tokens(t.response_ids)
    assert view.base is not None and view.dtype == np.int32 and view[-1] == 4095


def test_schema_names_fields():
    schema = T.trajectory_schema()
    props = schema["$defs"]["Trajectory"]["properties"]
    assert {"id", "group_id", "prompt_ids", "response_ids", "loss_mask", "logprobs", "versions"} <= set(props)


def test_huge_mask_value_is_named():
    with pytest.raises(InvalidTrajectory) as err:
        T.normalize(make(loss_mask=[1, 2**70]))
    assert err.value.field == "loss_mask"

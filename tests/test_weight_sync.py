"""Weight-broadcast groups (agentrl/engines/weight_sync.py): wire compatibility with SGLang's
`init_custom_process_group` (real processes, gloo over loopback) and the flattened-bucket layout."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

from agentrl.engines.weight_sync import (
    describe,
    describe_publish,
    flatten_bucket,
    init_weights_update_group,
    plan_buckets,
    send_broadcast,
    send_bucket,
    stream_buckets,
)
from agentrl.net import free_port

# A copy of sglang.srt.utils.common.init_custom_process_group (sglang 0.5.12) and of what its
# update_weights_from_distributed does on the receiving side, per tensor and with load_format="flattened_bucket".
SGLANG_SIDE = textwrap.dedent(
    """
    import sys
    from datetime import timedelta
    import torch
    from torch.distributed.distributed_c10d import (
        Backend, PrefixStore, _new_process_group_helper, _world, rendezvous)

    def init_custom_process_group(backend, init_method, world_size, rank, group_name):
        timeout = timedelta(seconds=30)
        store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
        store.set_timeout(timeout)
        store = PrefixStore(group_name, store)
        pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                          backend_options=None, timeout=timeout)
        _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
        return pg

    pg = init_custom_process_group("gloo", f"tcp://127.0.0.1:{sys.argv[1]}", 2, 1, "weight_update_group")
    a = torch.empty(3, 4)
    b = torch.empty(5, dtype=torch.bfloat16)
    for t in (a, b):
        torch.distributed.broadcast(t, src=0, group=pg)
    flat = torch.empty(3 * 4 * 4 + 5 * 2, dtype=torch.uint8)
    torch.distributed.broadcast(flat, src=0, group=pg)
    fa, fb = flat[:48].view(torch.float32).view(3, 4), flat[48:].view(torch.bfloat16)
    print(float(a.sum()), float(b.float().sum()), float(fa.sum()), float(fb.float().sum()), flush=True)
    # SGLang's destroy_weights_update_group, then the last reference dropped while the interpreter runs: a gloo
    # group freed during the interpreter's finalization aborts it about one exit in six (torch 2.13, here:
    # "terminate called without an active exception", after the output above is complete).
    torch.distributed.destroy_process_group(pg)
    del pg
    """
)


def test_trainer_side_meets_sglang_group_over_gloo():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", SGLANG_SIDE, str(port)], stdout=subprocess.PIPE, text=True)
    group = init_weights_update_group("127.0.0.1", port, 0, 2, backend="gloo", timeout_s=30)
    a = torch.arange(12.0).reshape(3, 4)
    b = torch.full((5,), 2.0, dtype=torch.bfloat16)
    meta = send_broadcast(group, [("a", a), ("b", b)])
    bucket_meta = send_bucket(group, [("a", a + 1), ("b", b * 2)])
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    assert [float(x) for x in out.split()] == [66.0, 10.0, 78.0, 20.0]
    assert meta.names == ["a", "b"] and meta.dtypes == ["float32", "bfloat16"] and meta.extra == {}
    assert bucket_meta.extra == {"load_format": "flattened_bucket"} and bucket_meta.shapes == [[3, 4], [5]]


def test_plan_buckets_keeps_order_and_limit():
    items = [(f"t{i}", torch.zeros(n, dtype=torch.float32)) for i, n in enumerate([10, 10, 30, 5, 5, 100])]
    buckets = plan_buckets(items, bucket_bytes=80)
    assert [[n for n, _ in b] for b in buckets] == [["t0", "t1"], ["t2"], ["t3", "t4"], ["t5"]]
    assert all(sum(t.numel() * 4 for _, t in b) <= 80 for b in buckets if len(b) > 1)


def test_publish_description_matches_the_streamed_buckets():
    """`describe_publish` (what engines are told) and `stream_buckets` over a one-shot iterator (what the
    learner sends) split the same way; 0 bytes = one source, a broadcast per tensor."""
    items = [(f"t{i}", torch.zeros(n, dtype=torch.float32)) for i, n in enumerate([10, 10, 30, 5, 5, 100])]
    sources = describe_publish("g", items, 80)
    streamed = list(stream_buckets(iter(items), 80))
    assert (
        [s.names for s in sources]
        == [[n for n, _ in b] for b in streamed]
        == [[n for n, _ in b] for b in plan_buckets(items, 80)]
    )
    assert all(s.extra == {"load_format": "flattened_bucket"} for s in sources)
    (whole,) = describe_publish("g", items, 0)
    assert whole.names == [n for n, _ in items] and whole.extra == {}


def test_flatten_bucket_layout_round_trips():
    items = [
        ("x", torch.randn(2, 3)),
        ("y", torch.arange(4, dtype=torch.int64)),
        ("z", torch.randn(3).bfloat16()),
    ]
    flat = flatten_bucket(items)
    assert flat.dtype == torch.uint8 and flat.numel() == 2 * 3 * 4 + 4 * 8 + 3 * 2
    offset = 0
    for _, t in items:
        n = t.numel() * t.element_size()
        assert torch.equal(flat[offset : offset + n].view(t.dtype).view(t.shape), t)
        offset += n
    assert describe("g", items, load_format="flattened_bucket").dtypes == ["float32", "int64", "bfloat16"]

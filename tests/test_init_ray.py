import os


def test_a_local_ray_runs_the_actors_at_the_drivers_niceness(monkeypatch):
    """Ray's default starts workers at niceness 15; on a machine with other busy processes the run's actors
    would then starve. A cluster agentrl starts keeps them at the driver's."""
    import ray

    from agentrl.config import load_config
    from agentrl.runner.loop import init_ray

    monkeypatch.delenv("RAY_worker_niceness", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    assert not ray.is_initialized()
    assert init_ray(load_config(None, ["--run.ray-num-cpus", "1"])) is True
    try:

        @ray.remote(num_cpus=0)
        def niceness() -> int:
            return os.nice(0)

        assert ray.get(niceness.remote()) == os.nice(0)
    finally:
        ray.shutdown()

"""agentrl.envs."""

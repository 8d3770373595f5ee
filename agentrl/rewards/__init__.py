"""agentrl.rewards."""

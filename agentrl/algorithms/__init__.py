"""agentrl.algorithms."""

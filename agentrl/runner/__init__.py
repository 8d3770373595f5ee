"""agentrl.runner."""

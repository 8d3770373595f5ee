"""agentrl.queue."""

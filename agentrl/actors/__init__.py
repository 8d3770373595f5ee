"""agentrl.actors."""

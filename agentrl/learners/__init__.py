"""agentrl.learners."""

"""agentrl: asynchronous RL post-training for LLM agents around one versioned replay queue.

Importing the package imports nothing heavy: torch and ray load only in the modules that need them.
"""

__version__ = "0.1.0"

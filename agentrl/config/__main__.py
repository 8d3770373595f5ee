"""`python -m agentrl.config > docs/config.md`: print the config reference."""

from agentrl.config import REGENERATE_DOCS, Config
from agentrl.config.docs import markdown_reference

print(markdown_reference(Config, REGENERATE_DOCS), end="")

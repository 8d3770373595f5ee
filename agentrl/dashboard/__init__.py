"""See a run: the curves (`curves`), the run directory's files read for display (`runfiles`), the HTTP
dashboard and trajectory viewer (`server`, `static/`), and `agentrl dashboard` (`cli`)."""

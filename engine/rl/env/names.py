"""Names shared by the env package without importing its modules."""

ENV_TOOLS = "tools"          # env.fn of the built-in tool environment

"""PROCESS_GROUP_TIMEOUT_S alone: how long a collective waits for its slowest rank. The RL
judge check (engine.rl.judge.checks) compares a deadline with it before any process group
exists, without parallel.process_groups' megatron-core import; that module re-exports it.
"""

PROCESS_GROUP_TIMEOUT_S = 1800   # a collective waits this long for its slowest rank

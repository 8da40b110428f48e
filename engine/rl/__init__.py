"""GRPO / DAPO reinforcement learning."""

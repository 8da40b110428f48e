"""Scripts launched with torchrun by the multi-rank tests (gloo on CPU); not collected by pytest."""

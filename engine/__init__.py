"""Training engines (SFT, RL) built on the models bridge and the parallel layer."""

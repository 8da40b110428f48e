"""`python -m engine.rl ...` / `torchrun ... -m engine.rl ...`: the GRPO/DAPO loop
(engine.rl.loop)."""
from engine.rl.loop import main

if __name__ == "__main__":
    raise SystemExit(main())
